"""/metrics under vLLM's names, parsed with prometheus_client's own parser."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.metrics import ServerMetrics
from tests.fake_engine import FakeAsyncLLM, serve_in_thread

REQUIRED = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
    "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count", "jaxserve:xla_compilations_total",
]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(parsed: dict, name: str, **labels: str) -> float:
    return parsed[(name, tuple(sorted({"model_name": "fake-model", **labels}.items())))]


def test_metrics_endpoint_after_requests() -> None:
    engine = FakeAsyncLLM()
    with serve_in_thread(build_app(engine)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        for k in range(3):
            client.completions.create(model="fake-model", prompt=f"w{k}", max_tokens=4)
        client.completions.create(model="fake-model", prompt="w10", max_tokens=8, stop="w12")
        list(client.completions.create(model="fake-model", prompt="w1 w2", max_tokens=2, stream=True))
        response = httpx.get(f"{base}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    parsed = samples(response.text)
    names = {name for name, _ in parsed}
    assert not [n for n in REQUIRED if n not in names]
    assert all(dict(labels).get("model_name") == "fake-model" for _, labels in parsed)
    assert value(parsed, "vllm:request_success_total", finished_reason="length") == 4
    assert value(parsed, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(parsed, "vllm:prompt_tokens_total") == 3 + 1 + 2
    assert value(parsed, "vllm:generation_tokens_total") == 3 * 4 + 2 + 2
    assert value(parsed, "vllm:e2e_request_latency_seconds_count") == 5
    assert value(parsed, "vllm:time_to_first_token_seconds_count") == 5
    assert value(parsed, "vllm:inter_token_latency_seconds_count") == 3 * 3 + 1 + 1  # tokens - 1 each
    assert value(parsed, "vllm:num_requests_running") == 0
    assert value(parsed, "jaxserve:xla_compilations_total") == 3


def test_each_app_has_its_own_registry() -> None:
    first, second = FakeAsyncLLM(model_name="a"), FakeAsyncLLM(model_name="b")
    app_a, app_b = build_app(first), build_app(second)  # no "Duplicated timeseries" error
    assert app_a.state.metrics.registry is not app_b.state.metrics.registry


def test_observe_finished_by_hand() -> None:
    metrics = ServerMetrics(FakeAsyncLLM())
    timing = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0,
                            last_token_time=11.4, finished_time=11.4, token_times=[11.0, 11.2, 11.4])
    out = RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2], finished=True, metrics=timing,
                        outputs=[CompletionOutput(0, "x", [4, 5, 6], finish_reason="stop")])
    metrics.observe_finished(out)
    body, _ = metrics.render()
    parsed = samples(body.decode())
    assert value(parsed, "vllm:time_to_first_token_seconds_sum") == 1.0
    assert value(parsed, "vllm:request_queue_time_seconds_sum") == 0.5
    assert abs(value(parsed, "vllm:e2e_request_latency_seconds_sum") - 1.4) < 1e-9
    assert abs(value(parsed, "vllm:time_per_output_token_seconds_sum") - 0.2) < 1e-9
    assert value(parsed, "vllm:inter_token_latency_seconds_count") == 2
    assert value(parsed, "vllm:request_success_total", finished_reason="stop") == 1

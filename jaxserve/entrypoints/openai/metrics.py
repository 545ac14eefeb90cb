"""Prometheus metrics under vLLM's names (`vllm:`), so its Grafana dashboards work unchanged.

Three sources, one per-app `CollectorRegistry` (tests build several apps):
  * gauges and engine-wide cumulative counters are read from `EngineStats` at
    scrape time by `_EngineStatsCollector`: the engine already keeps these
    totals, so the server never double-counts them;
  * histograms and `request_success_total` are observed by the server from each
    finished request's `RequestOutput.metrics` (one place that sees every request);
  * our own: `jaxserve:xla_compilations_total` (a compilation while serving is a bug).

`*_usage_perc` are fractions in [0, 1], as in vLLM despite the name.
"""

from __future__ import annotations

import time

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from jaxserve.engine.outputs import RequestOutput
from jaxserve.entrypoints.openai.engine_client import EngineClient

# vLLM's bucket boundaries (seconds), kept identical so dashboards' quantiles line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def _one_two_five_buckets(maximum: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `maximum`: token-count buckets, as vLLM builds them."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > maximum:
                return buckets
            buckets.append(float(value))
        exponent += 1


class _EngineStatsCollector(Collector):
    """Reads `EngineStats` on every scrape: gauges are current, counters are the engine's totals."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.get_stats()
        model = self._engine.model_name

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], float(value))
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])  # exposed as name_total
            family.add_metric([model], float(value))
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge("vllm:num_requests_swapped", "Requests swapped out to host memory.", stats.num_swapped)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of device KV blocks in use (0-1).", stats.kv_cache_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "Older name of kv_cache_usage_perc (0-1).", stats.kv_cache_usage)
        yield gauge("vllm:cpu_cache_usage_perc", "Fraction of host swap blocks in use (0-1).", stats.cpu_cache_usage)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Preemptions since start-up.", stats.num_preemptions)
        yield counter("vllm:prompt_tokens", "Prompt tokens computed.", stats.num_prompt_tokens)
        yield counter("vllm:generation_tokens", "Tokens generated.", stats.num_generation_tokens)
        yield counter("vllm:spec_decode_num_drafts", "Request-steps that carried speculative drafts.",
                      stats.spec_num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Speculative draft tokens proposed.",
                      stats.spec_num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.",
                      stats.spec_num_accepted_tokens)
        yield counter("jaxserve:xla_compilations", "XLA compilations since start-up.", stats.num_compilations)
        yield counter("jaxserve:xla_compilations_after_warmup",
                      "XLA compilations while serving (each one is a bug, unless --enforce-eager skipped the warm-up).",
                      stats.num_compilations_after_warmup)
        yield gauge("jaxserve:num_gpu_blocks", "KV blocks in the device pool.", stats.num_gpu_blocks)
        yield gauge("jaxserve:num_cpu_blocks", "KV blocks in the host swap pool.", stats.num_cpu_blocks)
        if getattr(stats, "max_lora", 0):  # vLLM's: value = the time, labels = the adapters by name
            info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
            info.add_metric([",".join(stats.running_lora_adapters), str(stats.max_lora),
                             ",".join(stats.waiting_lora_adapters)], time.time())
            yield info


class ServerMetrics:
    """The app's registry plus the per-request observations made by the serving handlers."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(engine))
        self._model = engine.model_name
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds",
                         "Per request: decode time / (generated tokens - 1).", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to finish.", REQUEST_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "First scheduled to finish.", REQUEST_BUCKETS)
        token_buckets = _one_two_five_buckets(max(engine.max_model_len, 1))
        self.prompt_tokens = hist("vllm:request_prompt_tokens", "Prompt length per request.", token_buckets)
        self.generation_tokens = hist("vllm:request_generation_tokens", "Generated tokens per request.",
                                      token_buckets)

    def observe_finished(self, output: RequestOutput) -> None:
        """Record one finished request; called once per request with its final output."""
        model = self._model
        reason = next((o.finish_reason for o in output.outputs if o.finish_reason), "abort")
        self.request_success.labels(model, reason).inc()
        self.prompt_tokens.labels(model).observe(len(output.prompt_token_ids))
        self.generation_tokens.labels(model).observe(sum(len(o.token_ids) for o in output.outputs))
        m = output.metrics
        if m is None:
            return
        if m.first_scheduled_time is not None:
            self.queue.labels(model).observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
        if m.first_token_time is not None:
            self.ttft.labels(model).observe(max(m.first_token_time - m.arrival_time, 0.0))
            if m.first_scheduled_time is not None:
                self.prefill.labels(model).observe(max(m.first_token_time - m.first_scheduled_time, 0.0))
        times = m.token_times
        for earlier, later in zip(times, times[1:]):
            self.itl.labels(model).observe(max(later - earlier, 0.0))
        if len(times) > 1:
            self.tpot.labels(model).observe(max(times[-1] - times[0], 0.0) / (len(times) - 1))
        if m.finished_time is not None:
            self.e2e.labels(model).observe(max(m.finished_time - m.arrival_time, 0.0))
            if m.first_token_time is not None:
                self.decode.labels(model).observe(max(m.finished_time - m.first_token_time, 0.0))
            if m.first_scheduled_time is not None:
                self.inference.labels(model).observe(max(m.finished_time - m.first_scheduled_time, 0.0))

    def observe_pooled(self, num_prompt_tokens: int, seconds: float) -> None:
        """One finished pooling request (one input of /v1/embeddings, /score, ...): arrival to its row."""
        model = self._model
        self.request_success.labels(model, "stop").inc()
        self.prompt_tokens.labels(model).observe(num_prompt_tokens)
        self.e2e.labels(model).observe(max(seconds, 0.0))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

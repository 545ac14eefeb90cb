"""Sleep, wake and pause (issue 48; jaxserve/engine/sleep.py, entrypoints/openai/dev_routes.py), on
conftest's tiny random Llama, the engine loading it itself (so it owns, and may delete, its arrays).

Greedy tokens are transformers' float32 tokens of the same weights, before a sleep and after the wake,
and for requests paused (keep), kept across a sleep (recomputed on wake) and resumed. After sleep the
KV pool's and the weights' device arrays are deleted and gone from jax.live_arrays(); waking compiles
nothing. The dev routes run through the real app and server, behind --api-key.
"""

from __future__ import annotations

import asyncio

import httpx
import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.exceptions import EngineSleepingError
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.dev_routes import dev_mode_enabled
from jaxserve.worker.programs import num_compilations
from tests.fake_engine import FakeAsyncLLM, serve_in_thread

pytestmark = pytest.mark.slow

EXACT = dict(dtype="float32", kv_cache_dtype="auto", block_size=16, speculative_config={})
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=24,
              enforce_eager=True, enable_sleep_mode=True, **EXACT)
PROMPTS = [[1, 50, 400, 3000, 77, 12, 9], [5000, 6, 7, 801]]
NUM_TOKENS = 8
LONG = 48  # long enough that a pause posted after the first token lands well before the end
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_tokens(tiny_llama_dir) -> list[list[int]]:
    """transformers' float32 greedy tokens, LONG per prompt (no stop at EOS)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=LONG, do_sample=False, pad_token_id=0,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
                for p in PROMPTS]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), progress=False, **ENGINE)
    for _ in range(2):  # --enforce-eager: the programs these requests use compile here, not in a test
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    yield llm
    llm.shutdown()


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def device_arrays(llm) -> list[jax.Array]:
    runner = llm.llm_engine.runner
    return [x for x in jax.tree.leaves(runner.params) + jax.tree.leaves(runner.kv) if isinstance(x, jax.Array)]


# ---- offline: LLM -------------------------------------------------------------------------------------
def test_sleep_level1_frees_the_device_and_wakes_to_the_same_tokens(llm, hf_tokens) -> None:
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == [t[:NUM_TOKENS] for t in hf_tokens]
    arrays = device_arrays(llm)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.llm_engine.runner.params))
    kv_shapes = {x.shape for x in jax.tree.leaves(llm.llm_engine.runner.kv)}
    before = num_compilations()
    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert all(x.is_deleted() for x in arrays)
    live = jax.live_arrays()
    assert not any(a is x for a in live for x in arrays)
    assert not any(a.shape in kv_shapes for a in live), "the KV pool is still on the device"
    host = llm.llm_engine._sleep.weights.host  # level 1: the weights wait in host memory, as numpy
    assert all(isinstance(h, np.ndarray) for h in host.values()) and sum(h.nbytes for h in host.values()) == weight_bytes
    with pytest.raises(EngineSleepingError, match="wake_up"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == [t[:NUM_TOKENS] for t in hf_tokens]
    assert num_compilations() == before, "sleep, wake and the steps after compiled something"


def test_sleep_level2_wakes_in_two_steps_and_needs_new_weights(llm, hf_tokens, tiny_llama_dir) -> None:
    before = num_compilations()
    llm.sleep(level=2)
    assert not llm.llm_engine._sleep.weights.host, "level 2 keeps no host copy of the weights"
    llm.wake_up(tags=["weights"])  # nothing to bring back: the weights were dropped
    assert llm.is_sleeping(), "the KV pool is still asleep"
    with pytest.raises(EngineSleepingError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    with pytest.raises(EngineSleepingError, match="level=2"):  # not garbage: a clear error
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.update_weights_from_disk(str(tiny_llama_dir))  # what brings weights back (engine/weight_sync.py)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == [t[:NUM_TOKENS] for t in hf_tokens]
    assert num_compilations() == before


def test_bad_arguments_name_the_field(llm) -> None:
    for call, match in ((lambda: llm.sleep(level=3), "level"), (lambda: llm.wake_up(tags=["pool"]), "tags"),
                        (lambda: llm.llm_engine.pause_generation(mode="later"), "mode")):
        with pytest.raises(ValueError, match=match):
            call()
    assert not llm.is_sleeping() and not llm.llm_engine.is_paused()


# ---- AsyncLLM: pause and sleep with requests in flight ------------------------------------------------
@pytest.fixture(scope="module")
def async_llm(llm):
    """The module's engine behind AsyncLLM's thread (after the offline tests: one thread drives it)."""
    front = AsyncLLM(llm.llm_engine)
    yield front
    front._stop.set()  # the thread only: the llm fixture shuts the engine down
    front._wake.set()
    front._thread.join(timeout=30)


async def collect(front: AsyncLLM, prompt: list[int], rid: str, n: int, seen: list) -> list:
    async for out in front.generate(prompt, greedy(n), rid):
        seen.append(out)
    return seen


async def first_token(seen: list) -> None:
    while not seen:
        await asyncio.sleep(0.005)


def test_pause_keep_and_a_sleep_in_between_give_the_unpaused_tokens(async_llm, hf_tokens) -> None:
    async def run() -> None:
        seen0, seen1 = [], []
        first = asyncio.create_task(collect(async_llm, PROMPTS[0], "keep-0", LONG, seen0))
        await first_token(seen0)
        await async_llm.pause_generation(mode="keep")
        assert await async_llm.is_paused()
        await asyncio.sleep(0.05)  # the outputs delivered before the pause reach the collector
        n = len(seen0)
        second = asyncio.create_task(collect(async_llm, PROMPTS[1], "keep-1", LONG, seen1))
        await asyncio.sleep(0.3)
        assert len(seen0) == n and not seen1, "a step ran while paused"
        await async_llm.sleep(level=1, mode="keep")  # the kept request's KV goes: recomputed on wake
        assert await async_llm.is_sleeping()
        await async_llm.wake_up()
        assert await async_llm.is_paused(), "wake_up resumes only what sleep paused"
        await async_llm.resume_generation()
        outs = await asyncio.wait_for(asyncio.gather(first, second), 120)
        assert [list(o[-1].outputs[0].token_ids) for o in outs] == hf_tokens
        assert n < LONG
    asyncio.run(run())


def test_pause_abort_ends_requests_and_wait_lets_them_finish(async_llm, hf_tokens) -> None:
    async def run() -> None:
        seen, later = [], []
        task = asyncio.create_task(collect(async_llm, PROMPTS[0], "abort-0", LONG, seen))
        await first_token(seen)
        await async_llm.pause_generation(mode="abort")
        final = (await asyncio.wait_for(task, 30))[-1]
        assert final.finished and final.outputs[0].finish_reason == "abort"
        assert len(final.outputs[0].token_ids) < LONG
        queued = asyncio.create_task(collect(async_llm, PROMPTS[1], "abort-1", NUM_TOKENS, later))
        await asyncio.sleep(0.2)
        assert not later, "a request added while paused ran"
        await async_llm.resume_generation()
        assert list((await asyncio.wait_for(queued, 60))[-1].outputs[0].token_ids) == hf_tokens[1][:NUM_TOKENS]

        seen = []
        task = asyncio.create_task(collect(async_llm, PROMPTS[0], "wait-0", 24, seen))
        await first_token(seen)
        await async_llm.pause_generation(mode="wait")  # returns once the request in flight is done
        assert async_llm.engine.drained()
        final = (await asyncio.wait_for(task, 5))[-1]
        assert final.outputs[0].finish_reason == "length" and list(final.outputs[0].token_ids) == hf_tokens[0][:24]
        await async_llm.resume_generation()
    asyncio.run(run())


# ---- HTTP: the dev routes -----------------------------------------------------------------------------
def test_dev_routes_over_http_behind_the_api_key(async_llm) -> None:
    key = {"Authorization": "Bearer sekret"}
    with serve_in_thread(build_app(async_llm, api_key="sekret")) as url, \
            httpx.Client(base_url=url, timeout=60, headers=key) as http:
        assert httpx.post(f"{url}/sleep").status_code == 401
        assert httpx.get(f"{url}/is_sleeping").status_code == 401
        bad = http.post("/sleep", params={"level": "3"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
        assert http.post("/sleep", params={"level": "1"}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.post("/wake_up", params={"tags": "bogus"}).status_code == 400
        assert http.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        assert http.get("/is_paused").json() == {"is_paused": True}
        assert http.post("/resume").json() == {"status": "resumed"}
        assert http.get("/is_paused").json() == {"is_paused": False}
        body = {"model": async_llm.model_name, "prompt": PROMPTS[0], "max_tokens": NUM_TOKENS, "temperature": 0,
                "ignore_eos": True}
        text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert text == _engine_text(async_llm)  # the same request, not through HTTP


def _engine_text(front: AsyncLLM) -> str:
    async def run() -> str:
        return (await collect(front, PROMPTS[0], "direct-0", NUM_TOKENS, []))[-1].outputs[0].text
    return asyncio.run(run())


def test_dev_routes_are_off_without_the_flag(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    monkeypatch.delenv("JAXSERVE_SERVER_DEV_MODE", raising=False)
    fake = FakeAsyncLLM()
    with serve_in_thread(build_app(fake)) as url:
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                             ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused")):
            assert httpx.request(method, url + path).status_code == 404, path
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert dev_mode_enabled(fake)

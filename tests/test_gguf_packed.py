"""`--quantization gguf`: a GGUF's quantized tensors stay as their blocks on the device.

The reference is the `gguf` package's own `gguf.quants.dequantize` (bit for bit, on blocks made by
`gguf.quants.quantize` where it can, else random blocks with finite float16 scales) and, for the
engine, the float32 engine on gguf's dequantized values (held to transformers by test_default_model).
"""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxserve.quantization import gguf_packed as gp
from tests.logprob_parity import assert_logprobs_close, generated_logprobs

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0")  # gguf.quants.quantize writes these
F16_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,)}  # each block's float16 fields (gguf/quants.py's layouts)


def _blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `qtype` [rows, row bytes]: every bit pattern of the values, scales finite."""
    block, size = gp.BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in F16_OFFSETS[qtype]:
        scale = rng.normal(0, 0.02, (rows, cols // block)).astype(np.float16)
        raw[..., offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def _device(w: gp.GGUFWeight) -> gp.GGUFWeight:
    return jax.tree.map(jnp.asarray, w)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", list(gp.BLOCKS))
def test_dequantize_is_gguf_bit_for_bit(qtype: str) -> None:
    rng = np.random.default_rng(len(qtype) + ord(qtype[1]))
    # 10 blocks of 256 (2560 values): rows stored in two chunks, as a 0.5B model's down projection
    rows, cols = 6, 10 * 256
    cases = [_blocks(qtype, rows, cols, rng)]
    if qtype in QUANTIZABLE:
        cases.append(gguf.quants.quantize(rng.normal(0, 0.05, (rows, cols)).astype(np.float32), Q[qtype]))
    for raw in cases:
        want = gguf.quants.dequantize(raw, Q[qtype])
        w = _device(gp.pack(raw, qtype, rows, cols))
        assert _same_bits(np.asarray(jax.jit(gp.dequantize)(w)), want)
        assert w.q.shape[0] == 2  # the chunks
        for n_rows in (1, 3):  # one row: chunk by chunk; more: tiles of rows (one, as rows < 2 tiles)
            x = rng.normal(0, 1, (n_rows, cols)).astype(np.float32)  # the product reads the same values
            np.testing.assert_allclose(np.asarray(jax.jit(gp.matmul)(jnp.asarray(x), w)), x @ want.T, rtol=2e-5,
                                       atol=2e-6 * np.abs(x).sum(-1).max() * np.abs(want).max())
        ids = jnp.asarray([rows - 1, 0, 2])  # an embedding's lookup gathers the same rows
        assert _same_bits(np.asarray(gp.PackedEmbedding(w)[ids]), want[np.asarray(ids)])


def test_products_of_many_rows_go_tile_by_tile() -> None:
    """At more than one row the output rows are widened TILE_ROWS at a time (and a last partial tile)."""
    rng = np.random.default_rng(2)
    n, k = 2 * gp.TILE_ROWS + 5, 64
    raw = _blocks("Q4_1", n, k, rng)
    want = gguf.quants.dequantize(raw, Q.Q4_1)
    x = rng.normal(0, 1, (2, 3, k)).astype(np.float32)
    got = np.asarray(jax.jit(gp.matmul)(jnp.asarray(x), _device(gp.pack(raw, "Q4_1", n, k))))
    np.testing.assert_allclose(got, x @ want.T, rtol=1e-5, atol=1e-5 * np.abs(want).max() * np.abs(x).sum(-1).max())


@pytest.mark.parametrize("types", [("Q4_K", "Q6_K"), ("Q5_0", "Q8_0")])  # a Q4_K_M file's mixed stacks
def test_a_stack_of_mixed_types_keeps_each_layers_values(types: tuple[str, str]) -> None:
    rng = np.random.default_rng(1)
    cols = gp.BLOCKS[types[0]][0] * 2
    raws = [_blocks(t, 4, cols, rng) for t in types]
    stacked = _device(gp.stack([gp.pack(r, t, 4, cols) for r, t in zip(raws, types)]))
    assert stacked.qtypes == types and stacked.shape == (2, cols, 4)
    got = np.asarray(jax.jit(gp.dequantize)(stacked))
    for layer, (raw, t) in enumerate(zip(raws, types)):
        assert _same_bits(got[layer], gguf.quants.dequantize(raw, Q[t]))


def test_gguf_is_refused_where_it_does_not_apply(tmp_path, jax_default_model) -> None:
    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.weights.loader import load_model

    with pytest.raises(ValueError, match="^quantization: 'gguf' is applied while the engine loads"):
        LLMEngine(EngineArgs(quantization="gguf"), model=jax_default_model, progress=False)

    with pytest.raises(ValueError, match="^quantization gguf runs on one device"):
        EngineArgs(quantization="gguf", tensor_parallel_size=2)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama", '
                                          '"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, '
                                          '"num_hidden_layers": 1, "num_attention_heads": 2}')
    with pytest.raises(ValueError, match="^quantization: 'gguf' .* not a .gguf file"):
        load_model(str(tmp_path), quantization="gguf", progress=False)


def test_engine_matches_the_float32_engine_on_the_default_model() -> None:
    """The packed model computes with gguf's values, the float32 path's (which tests/test_default_model.py
    holds to transformers): the same greedy tokens, logprobs within the float32 parity tolerance (the
    products' summation order differs), under the exact flags."""
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    kw = dict(dtype="float32", kv_cache_dtype="auto", block_size=16, speculative_config={}, enforce_eager=True,
              max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, progress=False)
    prompts, sampling = ["The capital of France is", "def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=8,
                                                                                         logprobs=0)
    outs = {}
    for quantization in ("gguf", None):
        llm = LLM(None, quantization=quantization, **kw)
        if quantization:
            params = llm.llm_engine.model.params
            assert isinstance(params["embed"], gp.PackedEmbedding) and params["lm_head"] is params["embed"].w
            assert {params["layers"][k].qtypes for k in ("wq", "w_down")} == {("Q4_1",)}
        outs[quantization] = [o.outputs[0] for o in llm.generate(prompts, sampling, use_tqdm=False)]
        del llm
    assert [o.token_ids for o in outs["gguf"]] == [o.token_ids for o in outs[None]]
    assert_logprobs_close([generated_logprobs(o) for o in outs["gguf"]], [generated_logprobs(o) for o in outs[None]],
                          what="--quantization gguf")


@pytest.mark.warmup  # holds 0 compilations after warm-up
def test_one_sequence_decodes_on_one_row_with_no_compilation_after_warm_up() -> None:
    """The start-up report's weight bytes count the tied head once (they counted it twice: 244 MiB
    against 142.7). A one-sequence decode step runs the 1-token model bucket and the 1-row sampler
    bucket (the fused one-row product), which warm-up compiled: a batch-1 and a batch-3 decode
    compile nothing. The prompt's tokens and logprobs are the batch-3 step's (the tile-by-tile
    product), which the test above holds to the float32 engine."""
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    llm = LLM(None, quantization="gguf", dtype="float32", kv_cache_dtype="auto", block_size=16,
              speculative_config={}, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, progress=False)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    assert runner.token_buckets[0] == 1 and runner.seq_buckets[0] == 1
    # the start-up report's weights: the tied head (the embedding's own blocks) counted once
    params = engine.model.params
    head = sum(x.nbytes for x in jax.tree.leaves(params["lm_head"]))
    assert params["lm_head"] is params["embed"].w
    assert engine.weight_bytes == sum(x.nbytes for x in jax.tree.leaves(params)) - head
    sampling = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    one = llm.generate(prompts[:1], sampling, use_tqdm=False)[0].outputs[0]
    three = llm.generate(prompts, sampling, use_tqdm=False)[0].outputs[0]
    assert engine.get_stats().num_compilations_after_warmup == 0
    assert one.token_ids == three.token_ids
    assert_logprobs_close([generated_logprobs(one)], [generated_logprobs(three)], what="batch 1 against batch 3")

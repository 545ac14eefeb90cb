"""The MoE block (jaxserve/models/moe.py) against a per-expert loop, the model registry, the
config aliases, and fused expert tensors (transformers >= 5's layout) read like per-expert ones."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import moe, registry
from jaxserve.models.config import ModelConfig


def _experts(rng, e=8, h=16, i=12):
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-1]), jnp.float32)  # noqa: E731
    return moe.Experts(w(e, i, h), w(e, i, h), w(e, h, i))  # [E, out, in]


def _reference(x, ids, weights, ex):
    """A Python loop over each token's chosen experts."""
    x, ids, weights = map(np.asarray, (x, ids, weights))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            g, u = np.asarray(ex.w_gate[e]) @ x[t], np.asarray(ex.w_up[e]) @ x[t]
            out[t] += weights[t, j] * (np.asarray(ex.w_down[e]) @ (g / (1 + np.exp(-g)) * u))
    return out


U = 2.0**-8  # bfloat16's unit roundoff (8 significant bits): tests/test_bf16_accuracy.py


def _assert_bf16_close(got, want, rms: float, peak: float) -> None:
    """A bfloat16 path against the float32 reference: rms error within `rms` of the reference's rms,
    every element within `peak` of its largest magnitude."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    ratio = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))
    assert ratio <= rms, f"rms error {ratio / U:.2f}u > {rms / U:.0f}u"
    worst = np.abs(got - want).max() / np.abs(want).max()
    assert worst <= peak, f"largest error {worst / U:.2f}u of the largest output > {peak / U:.0f}u"


@pytest.mark.parametrize("num_tokens", [1, 3, 13, 40, 200])  # gather (T*k <= 4E: one chunk of 8 rows, 4), batched
@pytest.mark.parametrize("skew", [0.0, 30.0])  # 30: every token chooses expert 0 (several rounds)
def test_moe_equals_a_loop_over_experts(num_tokens, skew):
    rng = np.random.default_rng(num_tokens)
    ex = _experts(rng)
    x = jnp.asarray(rng.standard_normal((num_tokens, 16)), jnp.float32)
    bias = jnp.zeros(8).at[0].set(skew)
    router = moe.Router(jnp.asarray(rng.standard_normal((16, 8)), jnp.float32), bias, top_k=2, norm_topk_prob=True)
    ids, weights = moe.route(x, router)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-5)
    got = jax.jit(moe.moe)(x, router, ex)
    np.testing.assert_allclose(got, _reference(x, ids, weights, ex), rtol=2e-4, atol=2e-4)
    if skew and num_tokens >= 40:  # the largest group overflows one round's capacity: nothing dropped
        sizes = np.bincount(np.asarray(ids).ravel(), minlength=8)
        assert sizes.max() > moe.capacity(num_tokens * 2, 8)


@pytest.mark.parametrize("skew", [0.0, 30.0])
def test_the_gather_path_in_chunks_of_16(skew):
    """Past 64 rows the gather path runs chunks of 16 (moe.GATHER_CHUNK): 42 tokens x top-2 over 32
    experts (84 rows <= 4E), the last chunk part padding; skewed: expert 0's 42 rows span 3 chunks."""
    rng = np.random.default_rng(5)
    ex = _experts(rng, e=32)
    x = jnp.asarray(rng.standard_normal((42, 16)), jnp.float32)
    bias = jnp.zeros(32).at[0].set(skew)
    router = moe.Router(jnp.asarray(rng.standard_normal((16, 32)), jnp.float32), bias, top_k=2, norm_topk_prob=True)
    ids, weights = moe.route(x, router)
    assert 64 < ids.size <= moe._gather_max_rows(ex) and ids.size % moe.GATHER_CHUNK[1]
    np.testing.assert_allclose(jax.jit(moe.moe)(x, router, ex), _reference(x, ids, weights, ex), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("num_tokens", [2, 40])  # gather path, batched path
def test_bfloat16_experts_equal_the_loop_over_their_values(num_tokens):
    """`--dtype bfloat16`: bfloat16 stacks and activations through both paths, against the loop over
    the same values in float32."""
    rng = np.random.default_rng(7)
    base = _experts(rng)
    ex = moe.Experts(*(w.astype(jnp.bfloat16) for w in (base.w_gate, base.w_up, base.w_down)))
    x = jnp.asarray(rng.standard_normal((num_tokens, 16)), jnp.bfloat16)
    router = moe.Router(jnp.asarray(rng.standard_normal((16, 8)), jnp.bfloat16), None, top_k=2, norm_topk_prob=True)
    ids, weights = moe.route(x, router)
    got = jax.jit(moe.moe)(x, router, ex)
    assert got.dtype == jnp.bfloat16
    as32 = moe.Experts(*(w.astype(jnp.float32) for w in (ex.w_gate, ex.w_up, ex.w_down)))
    want = _reference(x.astype(jnp.float32), ids, weights, as32)
    # bfloat16 activations all the way (u = 2^-8 relative per rounding, at most u / sqrt(3) rms): the
    # SwiGLU's intermediates, the down dot's inputs and the output each rounded -- about 2u rms of the
    # output's size (measured 1.6-2.3u); bound 4u rms, and 8u of the largest output for any one
    _assert_bf16_close(got, want, rms=4 * U, peak=8 * U)


@pytest.mark.parametrize("form", ["float", "float+views", "fp8_block", "mxfp4"])
@pytest.mark.parametrize("num_tokens", [3, 40])  # gather path; the per-expert loop (views: the batched dots)
def test_a_layer_read_lazily_from_the_stack_of_layers_equals_its_own_stacks(form, num_tokens):
    """The layer scan hands the experts over as LayerStack(stack [L, E, ...], layer): every path reads
    (layer, expert) in one slice and gives what the layer's own [E, ...] stacks give. float+views:
    with the layers as arrays of their own sharing the stack's memory (the runner's, on one CPU
    device), which the batched dots branch to."""
    from jaxserve.models.expert_weights import VIEW_PARTS, LayerStack, layer_views
    from jaxserve.quantization.mxfp4 import Mxfp4Weight
    from jaxserve.quantization.qweight import QuantizedWeight

    def pack(w):  # [E, N, K] float32 -> the form, as a checkpoint of it loads (values: any)
        e, n, k = w.shape
        if form == "fp8_block":  # 32 x 32 blocks
            scales = np.abs(np.asarray(w).reshape(e, n // 32, 32, k // 32, 32)).max(axis=(2, 4)) / 448.0
            q = np.asarray(w) / np.repeat(np.repeat(scales, 32, 1), 32, 2)
            return QuantizedWeight(jnp.asarray(q).astype(jnp.float8_e4m3fn), jnp.asarray(scales, jnp.float32),
                                   scheme="fp8_block", group_size=32, block_cols=32)
        if form == "mxfp4":
            return Mxfp4Weight(jnp.asarray(rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)),
                               jnp.asarray(rng.integers(122, 128, (e, n, k // 32), dtype=np.uint8)))
        return w

    rng = np.random.default_rng(num_tokens)
    layers = [moe.Experts(*map(pack, (ex.w_gate, ex.w_up, ex.w_down)))
              for ex in (_experts(rng, e=8, h=64, i=64) for _ in range(3))]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)  # every leaf [3, ...]
    x = jnp.asarray(rng.standard_normal((num_tokens, 64)), jnp.float32)
    router = moe.Router(jnp.asarray(rng.standard_normal((64, 8)), jnp.float32), None, top_k=2, norm_topk_prob=True)
    views = (None,) * 3
    if form == "float+views":
        views = tuple(layer_views(w) for w in (stacked.w_gate, stacked.w_up, stacked.w_down))
        for w, vs in zip((stacked.w_gate, stacked.w_up, stacked.w_down), views):  # no bytes added
            parts = [v for layer in vs for v in layer]  # each layer's experts in VIEW_PARTS arrays
            assert len(vs) == 3 and len(parts) == 3 * VIEW_PARTS
            assert [v.unsafe_buffer_pointer() for v in parts] == [
                w.unsafe_buffer_pointer() + i * parts[0].nbytes for i in range(len(parts))]
    # views: a router that sends every token to experts 0 and 1 too (the loop, for a batch that
    # leaves most experts idle: moe._busy_batched)
    skewed = moe.Router(router.weight, jnp.asarray([50.0, 50.0] + [0.0] * 6), top_k=2, norm_topk_prob=True)
    for r in (router, skewed) if form == "float+views" else (router,):
        lazy = lambda x, st, vs, l: moe.moe(x, r, moe.Experts(*(  # noqa: E731
            LayerStack(w, l, v) for w, v in zip((st.w_gate, st.w_up, st.w_down), vs))))
        for layer in (0, 2):
            got = jax.jit(lazy)(x, stacked, views, jnp.int32(layer))
            want = jax.jit(moe.moe)(x, r, layers[layer])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [3, 40])  # gather path; the loop (float32 dots) or the batched dots (bfloat16)
def test_bfloat16_bits_read_as_their_float32_values(num_tokens):
    """Stacks of bfloat16 values kept as their bits (the CPU default's experts of a bfloat16
    checkpoint: half the bytes), read lazily with the layers' own arrays: every float32 path gives
    exactly what the float32 stacks give; in a step of bfloat16 dots the batched dots read the
    layers' own arrays as bfloat16 (products of bfloat16-rounded rows)."""
    from jaxserve.models.expert_weights import BF16_BITS, VIEW_PARTS, LayerStack, bf16_bits, layer_views

    rng = np.random.default_rng(11)
    rounded = lambda w: w.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    layers = [jax.tree.map(rounded, _experts(rng, e=8, h=64, i=64)) for _ in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)  # [3, E, N, K] float32
    bits = jax.tree.map(bf16_bits, stacked)
    assert bf16_bits(stacked.w_gate + 1e-3) is None  # a value bfloat16 would round: kept float32
    for w, b in zip((stacked.w_gate, stacked.w_up, stacked.w_down), (bits.w_gate, bits.w_up, bits.w_down)):
        assert b.dtype == BF16_BITS and 2 * b.nbytes == w.nbytes
        np.testing.assert_array_equal(np.asarray(b).astype(np.uint32) << 16, np.asarray(w).view(np.uint32))
    views = tuple(layer_views(w) for w in (bits.w_gate, bits.w_up, bits.w_down))
    assert all(v.dtype == jnp.bfloat16 for vs in views for layer in vs for v in layer)
    x = jnp.asarray(rng.standard_normal((num_tokens, 64)), jnp.float32)
    router = moe.Router(jnp.asarray(rng.standard_normal((64, 8)), jnp.float32), None, top_k=2, norm_topk_prob=True)

    def lazy(x, st, vs, l, dots):
        return moe.moe(x, router, moe.Experts(*(LayerStack(w, l, v) for w, v in zip((st.w_gate, st.w_up, st.w_down), vs))),
                       dots)

    for layer in (0, 2):
        want = jax.jit(moe.moe)(x, router, layers[layer])
        got = jax.jit(lazy, static_argnums=4)(x, bits, views, jnp.int32(layer), None)
        # the same path over the float32 stacks (read lazily without views: gather, else the loop)
        same = jax.jit(lazy, static_argnums=4)(x, stacked, (None,) * 3, jnp.int32(layer), None)
        np.testing.assert_array_equal(got, same)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        if num_tokens * 2 > moe._gather_max_rows(moe.Experts(*(LayerStack(w, jnp.int32(0), v) for w, v in zip(
                (bits.w_gate, bits.w_up, bits.w_down), views)))):
            step = jax.jit(lazy, static_argnums=4)
            hlo = step.lower(x, bits, views, jnp.int32(layer), jnp.bfloat16).as_text()
            expert_dots = [ln for ln in hlo.splitlines() if "dot_general" in ln and "tensor<1x64x64xbf16>" in ln]
            assert len(expert_dots) == 3 * VIEW_PARTS * 3  # 3 layers' branches x 8 parts x gate, up, down
            bf16 = step(x, bits, views, jnp.int32(layer), jnp.bfloat16)
            # the weights are exact bfloat16 values; x is rounded for the gate and up dots and the
            # SwiGLU activations for the down dot (u = 2^-8 relative each, at most u / sqrt(3) rms), and
            # the router's bfloat16 logits move the combine weights: about u rms of the output's size
            # (measured 1.03u); bound 4u rms, and 8u of the largest output for any one (measured 1.7u)
            _assert_bf16_close(bf16, want, rms=4 * U, peak=8 * U)
            assert not np.array_equal(bf16, got)  # bfloat16 products, not the float32 loop's


def test_padding_rows_are_routed_nowhere():
    """`valid` (the step's real tokens): padding rows come out 0 and leave the real rows as they
    are, however many of them pick the same experts."""
    rng = np.random.default_rng(3)
    ex = _experts(rng)
    router = moe.Router(jnp.asarray(rng.standard_normal((16, 8)), jnp.float32), None, top_k=2, norm_topk_prob=True)
    real = jnp.asarray(rng.standard_normal((5, 16)), jnp.float32)
    for bucket in (8, 64):  # gather path, batched path (unmasked, 59 alike padding rows would overflow)
        x = jnp.concatenate([real, jnp.zeros((bucket - 5, 16), jnp.float32)])
        got = jax.jit(moe.moe)(x, router, ex, valid=jnp.arange(bucket) < 5)
        np.testing.assert_allclose(got[:5], jax.jit(moe.moe)(real, router, ex), rtol=1e-5, atol=1e-5)
        assert not np.any(np.asarray(got[5:]))


def test_ids_past_the_experts_are_not_computed():
    """Expert parallelism marks other devices' rows with id E: they come out as 0 on both paths."""
    rng = np.random.default_rng(0)
    ex = _experts(rng)
    for t in (2, 64):
        x = jnp.asarray(rng.standard_normal((t, 16)), jnp.float32)
        ids = jnp.asarray(rng.integers(0, 8, (t, 2)), jnp.int32).at[0, 1].set(8)
        y = moe.expert_swiglu(x, ids, ex)
        assert np.all(np.asarray(y[0, 1]) == 0) and np.any(np.asarray(y[0, 0]) != 0)


def test_router_kinds():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 16)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((16, 8)), jnp.float32)
    ids, p = moe.route(x, moe.Router(w, None, 3, False))
    probs = jax.nn.softmax(x @ w, axis=-1)
    np.testing.assert_allclose(p, jnp.take_along_axis(probs, ids, -1), rtol=1e-6)  # not renormalised
    ids2, p2 = moe.route(x, moe.Router(w, None, 3, False, "topk_softmax"))
    assert np.array_equal(ids, ids2)
    np.testing.assert_allclose(p2, jax.nn.softmax(jnp.take_along_axis(x @ w, ids, -1), -1), rtol=1e-6)


def test_registry_maps_every_family():
    archs = registry.supported_architectures()
    for arch, name in [("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral"),
                       ("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3"),
                       ("Qwen3MoeForCausalLM", "qwen3_moe"), ("Qwen2MoeForCausalLM", "qwen2_moe"),
                       ("MixtralForCausalLM", "mixtral")]:
        assert arch in archs and registry.family_name(arch) == name
        fam = registry.get_family(arch)
        assert callable(fam.ffn) and callable(fam.param_shapes) and callable(fam.layer_tensors)
    with pytest.raises(ValueError, match="not supported; supported: LlamaForCausalLM"):
        registry.get_family("BertModel")
    with pytest.raises(ValueError, match="config.json: unsupported architecture"):
        registry.resolve_architecture({"architectures": ["GPT2LMHeadModel"]})


HF = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
          moe_intermediate_size=16)


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts", "n_routed_experts"])
def test_num_experts_aliases(key):
    cfg = ModelConfig.from_hf({**HF, key: 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.moe.num_experts == 6
    assert cfg.moe.dense_layers == (0, 2, 3)  # (i + 1) % 2 != 0, and layer 3 listed
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # `jaxserve convert`'s marker
    assert cfg.moe.active_intermediate_size == 32


def test_missing_experts_is_a_clear_error():
    with pytest.raises(ValueError, match="missing required field 'num_experts'"):
        ModelConfig.from_hf(HF)


def test_fused_expert_tensors_load_like_per_expert_ones(tmp_path):
    """transformers >= 5 may write experts as `mlp.experts.gate_up_proj` [E, 2I, H] and
    `mlp.experts.down_proj` [E, H, I]: the loader detects it and reads the same weights."""
    from safetensors.numpy import save_file

    from tests.moe_fixtures import save_checkpoint
    from jaxserve.weights.loader import load_model

    src = save_checkpoint("mixtral", tmp_path / "per_expert")
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), "flax") as f:
        tensors = {k: np.asarray(f.get_tensor(k), np.float32) for k in f.keys()}
    fused = {}
    for name, arr in tensors.items():
        if ".experts." not in name:
            fused[name.replace("block_sparse_moe", "mlp")] = arr
    for layer in range(3):
        p = f"model.layers.{layer}.block_sparse_moe.experts."
        gate = np.stack([tensors[f"{p}{e}.w1.weight"] for e in range(8)])
        up = np.stack([tensors[f"{p}{e}.w3.weight"] for e in range(8)])
        down = np.stack([tensors[f"{p}{e}.w2.weight"] for e in range(8)])
        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = down
    out = tmp_path / "fused"
    out.mkdir()
    save_file(fused, str(out / "model.safetensors"))
    (out / "config.json").write_text((src / "config.json").read_text())
    a = load_model(str(src), "float32", progress=False).params["layers"]
    b = load_model(str(out), "float32", progress=False).params["layers"]
    assert set(a) == set(b)
    for leaf in a:
        np.testing.assert_array_equal(a[leaf], b[leaf], err_msg=leaf)


def test_plan_knows_moe_sizes():
    """`jaxserve plan` on the bundled Qwen3-30B-A3B config: 30.5 B parameters, 3.3 B active (its
    model card's figures), all of them in memory (bfloat16), half per device at TP 2."""
    from jaxserve.plan.source import read_model
    from jaxserve.worker import sizing
    from tests.test_plan import run_plan

    r = run_plan("Qwen/Qwen3-30B-A3B", "--gpu", "H200", "--max-model-len", "4096")
    assert round(r["total_params"] / 1e9, 1) == 30.5 and round(r["active_params_per_token"] / 1e9, 1) == 3.4
    assert r["fits"] and abs(r["weights_bytes_per_device"] - 2 * r["total_params"]) < 1e6
    cfg = read_model("Qwen/Qwen3-30B-A3B").config
    assert cfg.moe.num_experts == 128 and cfg.moe.num_experts_per_tok == 8 and cfg.moe.norm_topk_prob
    one = sizing.weight_bytes_per_device(cfg, 2)
    from jaxserve.models.config import with_expert_parallel
    for c in (cfg, with_expert_parallel(cfg, True)):  # TP splits expert widths, EP whole experts: half each
        assert abs(sizing.weight_bytes_per_device(c, 2, 2) - one / 2) < one * 0.01
    # on the CPU (float32 weights), the CPU default keeps this bfloat16 checkpoint's experts bfloat16
    # where this host has bfloat16 dots (LLMEngine): 2 bytes each; --dtype float32 keeps 4
    experts = sizing.weight_bytes_per_device(cfg, 4) - sizing.weight_bytes_per_device(cfg, 4, expert_width=2)
    assert experts == 2 * 128 * 3 * 768 * 2048 * 48  # half of the experts' float32 bytes
    full = run_plan("Qwen/Qwen3-30B-A3B", "--gpu", "cpu", "--dtype", "float32")
    auto = run_plan("Qwen/Qwen3-30B-A3B", "--gpu", "cpu")
    assert full["weights_bytes_per_device"] == 4 * full["total_params"]
    keeps = sizing.default_bf16_dots_from(True) > 0
    assert auto["expert_dtype_bytes"] == (2 if keeps else None)
    assert auto["weights_bytes_per_device"] == full["weights_bytes_per_device"] - (experts if keeps else 0)

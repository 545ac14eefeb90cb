"""What the Mixture-of-Experts families share: their config fields, leaves, weight names, sharding.

A MoE model's layers are Llama's attention half plus, per layer (leaves stacked on [L]):

    router   [L, H, E]                 (config.json's `mlp.gate`, our [in, out])
    we_gate, we_up [L, E, I, H]  we_down [L, E, H, I]    the experts, I = moe_intermediate_size, each
                                       [out, in] as the hub stores it (models/expert_weights.py)
    ws_gate, ws_up [L, H, S]  ws_down [L, S, H]  ws_router [L, H, 1]   a shared expert (Qwen2-MoE)
    w_gate, w_up [L, H, D]  w_down [L, D, H]  sparse [L]   only when some layers are dense

Dense layers between sparse ones (mlp_only_layers, decoder_sparse_step): each kind's leaves are
stacked over that kind's layers only (the router and experts over the sparse layers, w_gate/up/down
over the dense ones: models/layer_kinds.py), and the `sparse` flag (1.0 / 0.0) picks the branch in
the scan (`lax.cond`, one runs), which reads its row at the layer's index among its kind. A model
whose layers are all sparse (Qwen3-30B-A3B, Mixtral) holds experts only. The flag is a leaf, so
pipeline stages slice it with their layers (and each kind's rows of their layers).

Tensor parallelism without `--enable-expert-parallel`: every expert's intermediate axis I is
split (gate/up outputs, down inputs), as a dense MLP; with it, the expert axis E is split and
moe.moe adds the devices' partial sums with one psum.
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxserve.models.config import ModelConfig, MoeConfig, num_experts_from_hf
from jaxserve.models.layer_kinds import mixed_ffn, stack_shapes
from jaxserve.models.llama import attention_shapes, dense_mlp, mlp_shapes
from jaxserve.models.moe import Experts, Router, moe
from jaxserve.models.tensor_cuts import Cut, with_cuts
from jaxserve.quantization.qweight import fp8_block, stack, transposed

MODEL_AXIS = "model"


def moe_config(hf: Mapping, router: str = "softmax_topk", norm_topk_prob: bool | None = None,
               shared: bool = False) -> MoeConfig:
    """MoeConfig from config.json: the expert count under any alias, dense layers from
    mlp_only_layers and decoder_sparse_step (layer i is sparse when (i + 1) % step == 0)."""
    num_experts = num_experts_from_hf(hf)
    if num_experts is None:
        raise KeyError("num_experts")
    num_layers = int(hf["num_hidden_layers"])
    step = int(hf.get("decoder_sparse_step") or 1)
    only = {int(i) for i in hf.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    return MoeConfig(
        num_experts=num_experts, num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)) if norm_topk_prob is None else norm_topk_prob,
        router=router, shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0)
        if shared else 0, dense_layers=dense)


def moe_param_shapes(cfg: ModelConfig) -> dict:
    m = _moe(cfg)
    L, H, E, I = cfg.num_layers, cfg.hidden_size, m.num_experts, m.moe_intermediate_size
    shapes = attention_shapes(cfg)
    layers = shapes["layers"]
    layers.update(router=(L, H, E), we_gate=(L, E, I, H), we_up=(L, E, I, H), we_down=(L, E, H, I))
    if m.shared_expert_intermediate_size:
        layers.update(mlp_shapes(L, H, m.shared_expert_intermediate_size, "ws"), ws_router=(L, H, 1))
    if m.dense_layers:
        layers.update(mlp_shapes(L, H, cfg.intermediate_size), sparse=(L,))
    shapes["layers"] = stack_shapes(cfg, layers)  # each kind's leaves over its own layers
    return shapes


def moe_ffn(cfg: ModelConfig, lp: dict, x: jax.Array, dots=None, backend: str = "xla",
            valid: jax.Array | None = None) -> jax.Array:
    """One layer's feed-forward block: the routed experts (+ the gated shared expert), or the
    dense MLP in a dense layer of a mixed model. backend: the step's ("pallas": moe.moe's grouped
    matmul kernel); valid: the step's real tokens (moe.moe)."""
    m = _moe(cfg)

    def sparse(lp: dict, x: jax.Array) -> jax.Array:
        router = Router(lp["router"], None, m.num_experts_per_tok, m.norm_topk_prob, m.router)
        out = moe(x, router, Experts(lp["we_gate"], lp["we_up"], lp["we_down"]), dots, m.expert_parallel,
                  backend, valid)
        if m.shared_expert_intermediate_size:
            gate = jax.nn.sigmoid(x @ lp["ws_router"])  # [T, 1]
            out = out + gate * dense_mlp(cfg, lp, x, dots, prefix="ws")
        return out

    return mixed_ffn(cfg, lp, x, sparse, lambda lp, x: dense_mlp(cfg, lp, x, dots))


def moe_partition_rules(cfg: ModelConfig, tp: int) -> dict:
    """{leaf: (ok, spec, why not)} for the MoE leaves (the base rules cover w_gate/w_up/w_down)."""
    m = _moe(cfg)
    shared = m.shared_expert_intermediate_size
    rules: dict = {"router": (True, P(), ""), "ws_router": (True, P(), ""), "sparse": (True, P(), "")}
    if m.expert_parallel:
        ok = m.num_experts % tp == 0
        spec = P(None, MODEL_AXIS, None, None)
        why = f"num_experts {m.num_experts} not divisible by tensor parallel size {tp}"
        rules.update(we_gate=(ok, spec, why), we_up=(ok, spec, why), we_down=(ok, spec, why))
    else:
        ok = m.moe_intermediate_size % tp == 0
        why = f"moe_intermediate_size {m.moe_intermediate_size} not divisible by {tp}"
        rules.update(we_gate=(ok, P(None, None, MODEL_AXIS, None), why),
                     we_up=(ok, P(None, None, MODEL_AXIS, None), why),
                     we_down=(ok, P(None, None, None, MODEL_AXIS), why))
    if shared:
        ok, why = shared % tp == 0, f"shared_expert_intermediate_size {shared} not divisible by {tp}"
        rules.update(ws_gate=(ok, P(None, None, MODEL_AXIS), why), ws_up=(ok, P(None, None, MODEL_AXIS), why),
                     ws_down=(ok, P(None, MODEL_AXIS, None), why))
    return rules


# ---- weight names ---------------------------------------------------------------------------------

def expert_readers(cfg: ModelConfig, blocks: tuple[str, ...], per_expert: tuple[str, str, str]) -> dict:
    """Readers of the router and the three expert leaves of one layer, under the first block name
    of `blocks` the checkpoint has (Mixtral: block_sparse_moe, or mlp as transformers >= 5 names
    it). Experts are auto-detected per layer: per-expert tensors `{block}.experts.{e}.{name}.weight`
    with `per_expert` = (gate, up, down) names, or the fused 3D tensors transformers >= 5 writes,
    `{block}.experts.gate_up_proj` [E, 2I, H] (gate rows first) and `{block}.experts.down_proj` [E, H, I]."""
    m = _moe(cfg)
    E, I = m.num_experts, m.moe_intermediate_size

    def block(get, prefix: str) -> str:
        for b in blocks:
            try:
                get(f"{prefix}{b}.gate.weight")
                return b
            except KeyError:
                continue
        raise KeyError(f"{prefix}{blocks[0]}.gate.weight")

    def router(get, prefix: str) -> np.ndarray:
        return np.asarray(get(f"{prefix}{block(get, prefix)}.gate.weight")).T  # [E, H] -> [H, E]

    H = cfg.hidden_size
    shapes = ((I, H), (I, H), (H, I))  # gate, up, down: each expert [out, in]

    def expert_cuts(which: int) -> Callable:  # the weights API's names: the hub's per-expert tensors
        return lambda prefix: tuple(Cut(f"{prefix}{blocks[0]}.experts.{e}.{per_expert[which]}.weight", shapes[which],
                                        expert=e) for e in range(E))

    def expert(which: int) -> Callable:
        def read(get, prefix: str, linear=None):
            base = f"{prefix}{block(get, prefix)}.experts."
            if linear is not None:  # a quantized checkpoint: a stacked host QuantizedWeight [E, N, K]
                return quantized_experts(cfg, get, base, per_expert, which, linear)
            try:
                fused = np.asarray(get(base + ("down_proj" if which == 2 else "gate_up_proj")))
            except KeyError:
                return np.stack([np.asarray(get(f"{base}{e}.{per_expert[which]}.weight")) for e in range(E)])
            if which == 2:
                return fused  # [E, H, I]
            return fused[:, :I] if which == 0 else fused[:, I:]  # [E, I, H]
        return with_cuts(takes_linear(read), expert_cuts(which))

    router = with_cuts(router, lambda prefix: (Cut(f"{prefix}{blocks[0]}.gate.weight", (E, H), transpose=True),))
    return {"router": router, "we_gate": expert(0), "we_up": expert(1), "we_down": expert(2)}




def takes_linear(read: Callable) -> Callable:
    """Mark a reader (get, prefix, linear=None) that reads a quantized checkpoint's weights itself
    (weights/assemble.py passes it the checkpoint's linear reader)."""
    read.takes_linear = True
    return read


def unsupported_expert_quantization(method: str, scheme: str) -> str:
    return (f"quantization: {method} ({scheme}) checkpoints are not supported for MoE experts; a MoE model's "
            "experts load from block-wise fp8 (quant_method fp8 with weight_block_size, e.g. Qwen3-*-FP8, "
            "transformers' FineGrainedFP8Config), mxfp4 (gpt-oss), or float weights (quantized at load with "
            "--quantization fp8: attention and dense layers in e4m3, experts in the model dtype)")


def quantized_experts(cfg: ModelConfig, get, base: str, per_expert: tuple[str, str, str], which: int, linear):
    """One layer's gate (0), up (1) or down (2) experts of a block-wise FP8 checkpoint as one host
    QuantizedWeight [E, N, K] (output-major, as the float stacks): per-expert `{e}.{name}.weight`
    (e4m3 [N, K]) with their own `weight_scale_inv`, or, as transformers' FineGrainedFP8 save_pretrained writes them, with the
    layer's fused scales `gate_up_proj_scale_inv` [E, 2I / bn, H / bk] (gate block rows first) /
    `down_proj_scale_inv` [E, H / bn, I / bk]; or fused fp8 weights `gate_up_proj` / `down_proj`
    with those scales. `linear`: hf_linear.linear_reader's (prefix, (K, N)) -> QuantizedWeight."""
    m = _moe(cfg)
    E, I, H = m.num_experts, m.moe_intermediate_size, cfg.hidden_size
    k, n = (I, H) if which == 2 else (H, I)
    try:
        get(f"{base}0.{per_expert[which]}.weight_scale_inv")
    except KeyError:  # no per-expert scales: the fused ones below
        pass
    else:
        return transposed(stack([linear(f"{base}{e}.{per_expert[which]}", (k, n)) for e in range(E)]))
    fused = "down_proj" if which == 2 else "gate_up_proj"
    scales = np.asarray(get(f"{base}{fused}_scale_inv"), np.float32)  # [E, rows / bn, cols / bk]
    if linear.spec.scheme != "fp8_block":
        raise ValueError(unsupported_expert_quantization(linear.spec.method, linear.spec.scheme))
    bn, bk = linear.spec.block_size
    if which != 2:
        if I % bn:
            raise ValueError(f"{base}gate_up_proj_scale_inv: moe_intermediate_size {I} is not a multiple of "
                             f"the fp8 block {bn}, so the fused gate/up scales cannot be split")
        half = I // bn
        scales = scales[:, :half] if which == 0 else scales[:, half:]
    try:
        weights = [np.asarray(get(f"{base}{e}.{per_expert[which]}.weight")) for e in range(E)]  # [N, K] each
    except KeyError:
        w = np.asarray(get(base + fused))  # [E, 2I, H] or [E, H, I]
        weights = list(w if which == 2 else (w[:, :I] if which == 0 else w[:, I:]))
    return transposed(stack([fp8_block(weights[e], scales[e], (bn, bk)) for e in range(E)]))


def mixed_layer_tensors(cfg: ModelConfig, tensors: dict) -> dict:
    """`tensors` (leaf -> reader) plus the `sparse` flag of a model mixing dense and MoE layers; the
    loader reads each kind's leaves from that kind's layers only (layer_kinds.leaf_layers)."""
    m = _moe(cfg)
    if not m.dense_layers:
        return tensors
    return {**tensors, "sparse": lambda get, prefix: np.float32(m.is_sparse(int(prefix.rstrip(".").rsplit(".", 1)[1])))}


def check_quantization(cfg: ModelConfig, method: str, scheme: str) -> None:
    """ValueError at load for a checkpoint format whose MoE experts this code cannot read."""
    if cfg.moe is not None and scheme not in ("fp8_block", "mxfp4"):
        raise ValueError(unsupported_expert_quantization(method, scheme))


def _moe(cfg: ModelConfig) -> MoeConfig:
    if cfg.moe is None:
        raise ValueError(f"{cfg.architecture}: config has no experts (num_experts)")
    return cfg.moe


def shared_expert_tensors() -> dict:
    return {"ws_gate": ("mlp.shared_expert.gate_proj.weight", True),
            "ws_up": ("mlp.shared_expert.up_proj.weight", True),
            "ws_down": ("mlp.shared_expert.down_proj.weight", True),
            "ws_router": ("mlp.shared_expert_gate.weight", True)}



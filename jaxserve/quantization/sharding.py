"""Tensor-parallel PartitionSpecs for quantized weights: the scales shard with their weights.

The float plan (jaxserve.parallel.specs) gives each [L, in, out] weight one spec:
column-parallel P(None, None, "model") or row-parallel P(None, "model", None). A
QuantizedWeight expands it field by field:

    values [L, K', N]        the weight's spec (4-bit K' = K / 2: a row split cuts whole groups)
    scales, zeros [L, G, N]  column: split N like the values; row: split the groups G
                             (per channel, G = 1: whole on every device)
    perm [L, K], input_scale replicated (x is replicated when it is gathered by perm)

A row split needs G divisible by the axis (each device holds whole groups); otherwise
the weight is replicated.

MoE expert stacks are output-major, [L, E, N, K] (models/expert_weights.py): a block-wise fp8
one's scales [L, E, cdiv(N, bn), cdiv(K, bk)] split as its rows and columns. An Mxfp4Weight
(gpt-oss's experts, logical [L, E, N, K]) keeps K in 32-element blocks:

    blocks [L, E, N, K / 32, 16], scales [L, E, N, K / 32]    E and N split as planned; a K split
                                                              cuts whole blocks (K / 32 divisible)
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from jaxserve.quantization.mxfp4 import Mxfp4Weight
from jaxserve.quantization.qweight import QuantizedWeight


def quantized_spec(spec: P, w: QuantizedWeight, axis_size: int) -> QuantizedWeight:
    """A QuantizedWeight of PartitionSpecs (None where the field is None) for a weight planned as `spec`.
    The last two axes are [rows, columns] ([K, N]; a MoE expert stack's [N, K]); leading ones (the
    layer axis, a MoE stack's expert axis: split under expert parallelism) are split alike in every
    field."""
    nd = w.values.ndim
    dims = tuple(spec) + (None,) * (nd - len(tuple(spec)))
    lead, dk, dn = dims[:-2], dims[-2], dims[-1]
    num_groups = w.scales.shape[-2]
    if dk is not None and num_groups > 1 and num_groups % axis_size:  # groups would be cut
        dk = dn = None
    if w.scheme == "fp8_block" and dn is not None and (w.values.shape[-1] // axis_size) % w.block_cols:
        dk = dn = None  # a column split would cut scale blocks
    values = P(*lead, dk, dn)
    if dk is not None:  # row-parallel: per-channel scales are whole on every device
        scales = P(*lead, dk if num_groups > 1 else None, None)
    else:
        scales = P(*lead, None, dn)
    return QuantizedWeight(values, scales, None if w.zeros is None else scales, None if w.perm is None else P(),
                           None if w.input_scale is None else P(), w.scheme, w.group_size,
                           block_cols=w.block_cols)


def mxfp4_spec(spec: P, w: Mxfp4Weight, axis_size: int) -> Mxfp4Weight:
    """An Mxfp4Weight of PartitionSpecs for a weight planned as `spec` over its logical [..., E, N, K]."""
    nd = len(w.shape)
    dims = tuple(spec) + (None,) * (nd - len(tuple(spec)))
    lead, dn, dk = dims[:-2], dims[-2], dims[-1]
    if dk is not None and w.scales.shape[-1] % axis_size:  # a K split would cut a block of 32
        dk = None
    return Mxfp4Weight(P(*lead, dn, dk, None), P(*lead, dn, dk))


def expand_specs(specs: dict, params: dict, axis_size: int) -> dict:
    """The float plan's spec tree with each quantized leaf of `params` expanded (`quantized_spec`).
    Leaves of `params` missing from the plan (the int8 layout's fused ones) are replicated."""
    def expand(spec_node, param_node):
        if isinstance(param_node, QuantizedWeight):
            return quantized_spec(spec_node if isinstance(spec_node, P) else P(), param_node, axis_size)
        if isinstance(param_node, Mxfp4Weight):
            return mxfp4_spec(spec_node if isinstance(spec_node, P) else P(), param_node, axis_size)
        if isinstance(param_node, dict):
            return {k: expand(spec_node.get(k, P()) if isinstance(spec_node, dict) else P(), v)
                    for k, v in param_node.items()}
        return spec_node if isinstance(spec_node, P) else P()

    return expand(specs, params)


def is_spec(x: object) -> bool:
    return isinstance(x, P)

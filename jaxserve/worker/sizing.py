"""Memory sizing as pure functions of plain numbers: a model config, byte widths and parallel sizes.

The engine (llm_engine.py, kv_sizing.py, model_runner.kv_bytes_per_block) and `jaxserve plan`
call these same functions, so what `plan` predicts is what the engine allocates:

    weights per device   the partition plan's shard of every leaf (parallel/specs.py), for the
                         layers of the largest pipeline stage; quantized leaves by their scheme
    KV bytes per block   2 (K, V) x stage layers x kv heads on one device x block_size x head_dim x width;
                         MLA (DeepSeek): stage layers x (kv_lora_rank + qk_rope_head_dim) x block_size x width
    activation reserve   measured by an XLA dry run on accelerators; `activation_bytes_estimate`
                         otherwise (plan, and the engine when XLA gives no memory analysis)
    LoRA slots           --max-loras x --max-lora-rank columns of A and rows of B for every projection
                         an adapter may target, per layer, in --lora-dtype (their TP shard), and the
                         columns' owner ids (jaxserve/lora/layers.py): allocated with the weights
    KV blocks            (device bytes x gpu_memory_utilization - weights - LoRA slots - activations)
                         // per block, or --kv-cache-memory // per block on the CPU

No JAX arrays here: the partition plan is read as PartitionSpecs only.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

from jaxserve.constants import CPU_MAX_MODEL_LEN
from jaxserve.lora.layers import slot_specs
from jaxserve.lora.peft import module_dims
from jaxserve.models.config import ModelConfig
from jaxserve.models.expert_weights import EXPERT_STACKS
from jaxserve.models.layer_kinds import leaf_rows
from jaxserve.models.kv_layout import latent_values_per_token
from jaxserve.models.llama import param_shapes
from jaxserve.parallel.specs import KV_HEADS_AXIS, MODEL_AXIS, partition_plan
from jaxserve.parallel.stages import stage_layer_ranges  # noqa: F401  (also read as sizing.stage_layer_ranges)
from jaxserve.quantization import formats

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
CHUNKED_PREFILL_TOKENS = 512  # a step's token budget with chunked prefill, unless the flag says otherwise
# Above this --gpu-memory-utilization the engine refuses: the CUDA context, XLA's own buffers and the
# allocator's fragmentation need the rest, and a server sized to 0.98 dies of OOM at its first long batch.
MAX_GPU_MEMORY_UTILIZATION = 0.95
MATMUL_LEAVES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
EXPERT_LEAVES = EXPERT_STACKS  # a MoE layer's stacked experts [L, E, out, in]


@dataclass(frozen=True)
class QuantScheme:
    """How one quantized matmul weight [in, out] is stored: `bits` per weight, plus per group of
    `group_size` input rows (0: one group, i.e. per output channel) a scale of `scale_bytes` and a
    zero point of `zero_bits` for every output column."""
    bits: int
    group_size: int
    scale_bytes: int
    zero_bits: int
    lm_head: bool  # the LM head is quantized too (tied embeddings: a quantized copy of embed.T)
    leaves: tuple[str, ...] = MATMUL_LEAVES  # the layer leaves stored this way (the rest: the model dtype)

    def matrix_bytes(self, rows: int, cols: int) -> int:
        groups = -(-rows // self.group_size) if self.group_size else 1
        return rows * cols * self.bits // 8 + groups * cols * self.scale_bytes + groups * cols * self.zero_bits // 8


# Storage of each QuantizedWeight scheme (jaxserve/quantization/qweight.py) a checkpoint loads into.
STORAGE: dict[str, QuantScheme] = {
    "int8": QuantScheme(8, 0, 4, 0, lm_head=True),  # jaxserve's W8A8 (jaxserve/quantization): f32 per-channel scale
    "fp8": QuantScheme(8, 0, 4, 0, lm_head=False),  # e4m3 per output channel, as vLLM's fp8
    "w4a16": QuantScheme(4, 128, 2, 4, lm_head=False),  # AWQ / GPTQ / compressed-tensors 4-bit, group 128
    # gpt-oss: the experts only, e2m1 with an e8m0 scale per 32; attention and router stay float
    "mxfp4": QuantScheme(4, 32, 1, 0, lm_head=False, leaves=EXPERT_LEAVES),
    # --quantization gguf: one int8 a value and an f16 scale per 32 (Q8_0/Q4_0/Q5_0; Q4_1 and the
    # K-quants hold a little more), the untied head too (quantization/gguf_packed.py)
    "gguf": QuantScheme(8, 32, 2, 0, lm_head=True),
}
# Every --quantization method (formats.METHODS, the one list), sized as the scheme it loads into.
QUANT_SCHEMES: dict[str, QuantScheme] = {m: STORAGE[formats.SIZING_SCHEMES[m]] for m in formats.METHODS}


def dtype_bytes(name: str) -> int:
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype: must be one of {tuple(DTYPE_BYTES)}, got {name!r}")
    return DTYPE_BYTES[name]


def _shard_elems(shape: tuple[int, ...], spec: tuple, tp: int, kv_groups: int) -> int:
    """Elements of one device's shard of a leaf laid out by a PartitionSpec of the engine's plan."""
    n = 1
    for i, dim in enumerate(shape):
        axis = spec[i] if i < len(spec) else None
        n *= dim // (kv_groups if axis == KV_HEADS_AXIS else tp if axis == MODEL_AXIS else 1)
    return n


def stage_weight_bytes(cfg: ModelConfig, width: int, tensor_parallel_size: int = 1, stage: int = 0,
                       pipeline_parallel_size: int = 1, quantization: str | None = None,
                       expert_width: int | None = None) -> int:
    """Bytes of weights one device of pipeline `stage` holds: its layers' shards, the embedding on
    the first stage, the final norm and LM head on the last (tied: the embedding there too).
    `width`: bytes per element of the float weights (the model dtype); `expert_width`: of the float
    MoE expert stacks where they differ (the CPU default's bfloat16 experts: 2)."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    plan = partition_plan(cfg, tp)
    shapes = param_shapes(cfg)
    start, end = stage_layer_ranges(cfg.num_layers, pp)[stage]
    first, last = stage == 0, stage == pp - 1
    if quantization and quantization not in QUANT_SCHEMES:
        raise ValueError(f"quantization: must be one of {tuple(QUANT_SCHEMES)} or None, got {quantization!r}")
    scheme = QUANT_SCHEMES[quantization] if quantization else None
    total = 0
    for leaf, shape in shapes["layers"].items():
        spec = tuple(plan.specs["layers"][leaf])
        shard = _shard_elems(shape[1:], spec[1:], tp, plan.kv_groups)  # one layer's shard
        rows = leaf_rows(cfg, leaf, start, end)  # a mixed MoE's dense / expert leaves: their kind's layers
        stacked = rows[1] - rows[0]
        if scheme and leaf in scheme.leaves:  # [L, in, out] or [L, E, out, in]: the shard's matrices
            rows = _shard_elems(shape[-2:-1], spec[-2:-1], tp, plan.kv_groups)
            cols = _shard_elems(shape[-1:], spec[-1:], tp, plan.kv_groups)
            if leaf in EXPERT_LEAVES:  # input rows, output columns
                rows, cols = cols, rows
            total += stacked * shard // (rows * cols) * scheme.matrix_bytes(rows, cols)
        else:
            leaf_width = expert_width if expert_width and leaf in EXPERT_LEAVES else width
            total += stacked * shard * leaf_width
    embed = _shard_elems(shapes["embed"], tuple(plan.specs["embed"]), tp, plan.kv_groups) * width
    if first:
        total += embed
    if last:
        total += cfg.hidden_size * width  # final_norm
        head_cols = cfg.vocab_size // (tp if tuple(plan.specs["embed"]) else 1)
        if scheme and scheme.lm_head:
            total += scheme.matrix_bytes(cfg.hidden_size, head_cols)
        elif not cfg.tie_word_embeddings or not first:
            total += cfg.hidden_size * head_cols * width  # lm_head, or the tied embedding's copy
    return total


def weight_bytes_per_device(cfg: ModelConfig, width: int, tensor_parallel_size: int = 1,
                            pipeline_parallel_size: int = 1, quantization: str | None = None,
                            expert_width: int | None = None) -> int:
    """The most weight bytes any one device holds (the largest stage's)."""
    return max(stage_weight_bytes(cfg, width, tensor_parallel_size, s, pipeline_parallel_size, quantization,
                                  expert_width) for s in range(pipeline_parallel_size))


def lora_slot_bytes(cfg: ModelConfig, max_loras: int, max_lora_rank: int, width: int,
                    tensor_parallel_size: int = 1) -> int:
    """Bytes of the LoRA slots on one device (0 when max_loras is 0: LoRA off): for each projection
    (in, out), A [L, in, S*R] and B [L, S*R, out] at `width` bytes, each split as its projection
    (lora/layers.slot_specs), plus the columns' owners [S*R] i32."""
    if max_loras <= 0:
        return 0
    tp, cols = tensor_parallel_size, max_loras * max_lora_rank
    dims = module_dims(cfg)
    specs = slot_specs(dims, partition_plan(cfg, tp).specs["layers"] if tp > 1 else {})
    total = cols * 4
    for m, (n_in, n_out) in dims.items():
        total += _shard_elems((cfg.num_layers, n_in, cols), tuple(specs[m]["a"]), tp, 1) * width
        total += _shard_elems((cfg.num_layers, cols, n_out), tuple(specs[m]["b"]), tp, 1) * width
    return total


def kv_heads_per_device(cfg: ModelConfig, tensor_parallel_size: int) -> int:
    """The engine's KV pool split: by whole kv heads over TP, one head per replicated group, else all."""
    plan = partition_plan(cfg, tensor_parallel_size)
    spec = tuple(plan.kv_cache)
    axis = spec[1] if len(spec) > 1 else None
    return cfg.num_kv_heads // (plan.kv_groups if axis == KV_HEADS_AXIS else
                                tensor_parallel_size if axis == MODEL_AXIS else 1)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, width: int, tensor_parallel_size: int = 1,
                       pipeline_parallel_size: int = 1) -> int:
    """K and V bytes of one block over the largest stage's layers, on one device."""
    layers = max(e - s for s, e in stage_layer_ranges(cfg.num_layers, pipeline_parallel_size))
    latent = latent_values_per_token(cfg, layers)  # MLA: one latent entry per token and layer, replicated
    if latent is not None:
        return latent * block_size * width
    return 2 * layers * kv_heads_per_device(cfg, tensor_parallel_size) * block_size * cfg.head_dim * width


def activation_bytes_estimate(cfg: ModelConfig, num_tokens: int, num_rows: int, width: int,
                              tensor_parallel_size: int = 1) -> int:
    """A without-a-GPU estimate of one step's temporary device memory: the live tensors of one layer
    of the scan (it reuses them layer to layer) at `num_tokens` tokens -- the residual and its
    normed copy, q/k/v and the attention output, gate, up and their product, all at `width` -- plus
    the sampler's float32 logits over `num_rows` rows three times (logits, probabilities, the
    top-p sort). XLA fuses some of these away, so it is an upper estimate of the dry run's figure
    (tests/test_plan.py compares it with XLA's memory analysis on the CPU)."""
    tp = tensor_parallel_size
    q = cfg.num_heads * cfg.head_dim // tp
    kv = max(1, cfg.num_kv_heads // tp) * cfg.head_dim
    per_token = 3 * cfg.hidden_size + 2 * q + 2 * kv + 3 * -(-cfg.intermediate_size // tp)
    return num_tokens * per_token * width + 3 * num_rows * -(-cfg.vocab_size // tp) * 4


def default_max_model_len(max_position_embeddings: int, on_cpu: bool) -> int:
    return min(max_position_embeddings, CPU_MAX_MODEL_LEN if on_cpu else 1 << 30)


# Per-platform defaults of the flags a user did not set (EngineConfig.resolve; `jaxserve plan` sizes
# GPUs with the accelerator ones). On a CPU, measured on the default model (BENCHMARKS.md, issue 24):
# 64-token blocks make decode steps about 1.15x faster than 16 (fewer, larger gathers), and a
# bfloat16 KV pool about 1.1-1.25x (half the bytes; perplexity within 0.1% of float32's).
# On one CPU device, n-gram speculative decoding (k = 4): greedy requests verify drafts taken from
# their own earlier tokens, 1.2-1.8x output tok/s in-process on issue 24's workloads; the output is
# plain decoding's, and sampled requests never draft, so they pay nothing.
# On one CPU device with bfloat16 dot instructions (cpu_has_bf16_dots), --dtype auto keeps float32
# weights but runs the layers' projections of a step of CPU_BF16_DOTS_FROM tokens or more as
# bfloat16 x bfloat16 dots accumulated in float32: 1.2x float32's dot at 64 rows and 1.8x at 512
# on a Zen 4 host (below 64 rows float32 is as fast or faster); the sampler's LM head takes them in
# every step, a vocabulary slice at a time (1.5x float32's at 32-64 rows); perplexity within
# 0.2% of float32 on every shipped text (BENCHMARKS.md).
# `--block-size 16 --kv-cache-dtype auto --speculative-config '{}' --dtype float32` is the exact
# float32 configuration.
CPU_BF16_DOTS_FROM = 64
CPU_BLOCK_SIZE, ACCELERATOR_BLOCK_SIZE = 64, 16
CPU_KV_CACHE_DTYPE, ACCELERATOR_KV_CACHE_DTYPE = "bfloat16", "auto"
CPU_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4}


@functools.lru_cache(maxsize=1)
def cpu_has_bf16_dots() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (AVX512_BF16 or AMX-BF16: AMD Zen 4+,
    Intel Cooper Lake, Sapphire Rapids+), which XLA:CPU's bfloat16 dot runs on. The CPU default
    above is measured on such a host only; other CPUs keep float32 dots."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", info) is not None


def default_bf16_dots_from(on_cpu: bool) -> int:
    return CPU_BF16_DOTS_FROM if on_cpu and cpu_has_bf16_dots() else 0


def default_block_size(on_cpu: bool) -> int:
    return CPU_BLOCK_SIZE if on_cpu else ACCELERATOR_BLOCK_SIZE


def default_kv_cache_dtype(on_cpu: bool) -> str:
    return CPU_KV_CACHE_DTYPE if on_cpu else ACCELERATOR_KV_CACHE_DTYPE


def default_max_num_batched_tokens(max_model_len: int, enable_chunked_prefill: bool = True) -> int:
    return min(CHUNKED_PREFILL_TOKENS, max_model_len) if enable_chunked_prefill else max_model_len


def check_gpu_memory_utilization(value: float) -> None:
    if not 0.0 < value <= MAX_GPU_MEMORY_UTILIZATION:
        raise ValueError(f"gpu_memory_utilization must be in (0, {MAX_GPU_MEMORY_UTILIZATION}], got {value}: "
                         "the rest of the device is the CUDA context's, XLA's and the allocator's, and a "
                         "higher setting dies of out-of-memory under load")


def kv_budget(total_bytes: int, gpu_memory_utilization: float, weight_bytes: int, activation_bytes: int) -> int:
    """Bytes left for the KV pool; ValueError, with the numbers, when the weights and activation
    reserve alone exceed the allowed share of the device."""
    allowed = int(total_bytes * gpu_memory_utilization)
    if weight_bytes + activation_bytes > allowed:
        raise ValueError(
            f"gpu_memory_utilization: weights ({weight_bytes} bytes) + activation reserve ({activation_bytes} "
            f"bytes) = {weight_bytes + activation_bytes} bytes exceed {gpu_memory_utilization} x {total_bytes} "
            f"= {allowed} bytes of the device; use more tensor/pipeline parallelism, quantization, or a "
            f"smaller model (`jaxserve plan` finds a setting that fits)")
    return allowed - weight_bytes - activation_bytes


def blocks_per_seq(max_model_len: int, block_size: int) -> int:
    return math.ceil(max_model_len / block_size)

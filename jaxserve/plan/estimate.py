"""What one configuration needs per device, from worker/sizing.py (the engine's own arithmetic).

    weights          sizing.weight_bytes_per_device (largest pipeline stage, TP shard, quantization)
    activations      sizing.activation_bytes_estimate (the engine measures it by a dry run on GPUs)
    LoRA slots       sizing.lora_slot_bytes (--enable-lora: max_loras x max_lora_rank, every projection)
    KV               sizing.kv_bytes_per_block (with sliding-window KV groups, worker/kv_groups.py: a block
                     of k layers, a sequence holding its sliding groups' windows only); blocks = (memory x utilization - weights - LoRA - activations)
                     // per block (on `cpu`: --kv-cache-memory // per block, as the engine there)
    vision           a vision-language model's tower weights, its largest program's activations and the
                     host-side encoder cache (jaxserve/plan/vision.py)
    fits             at least one sequence of max_model_len fits in the pool
    roofline         decode is memory-bound: a step reads this device's weights and the batch's KV,
                     at max(bytes / bandwidth, FLOPs / peak); stages run one after another for one
                     sequence (no pipeline overlap assumed), so a step costs P x one stage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import param_shapes
from jaxserve.plan.gpus import Gpu
from jaxserve.plan.vision import vision_figures
from jaxserve.worker import sizing
from jaxserve.worker.kv_groups import kv_layout
from jaxserve.worker.kv_sizing import DEFAULT_CPU_KV_BYTES

TP_SIZES = (1, 2, 4, 8)
PP_SIZES = (1, 2, 3, 4, 8)
QUANT_FALLBACKS = ("fp8", "awq")


@dataclass(frozen=True)
class Setting:
    cfg: ModelConfig
    gpu: Gpu | None  # None: the CPU (pool = kv_cache_memory)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    quantization: str | None = None
    dtype_bytes: int = 2  # the float weights' and activations' width
    kv_dtype_bytes: int = 2
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_memory: int | None = None
    max_loras: int = 0  # LoRA slots (0: --enable-lora off)
    max_lora_rank: int = 16
    expert_dtype_bytes: int | None = None  # MoE experts' width where not dtype_bytes (the CPU default's bfloat16: 2)
    max_image_patches: int | None = None  # a VL model: the processor's largest image (preprocessor_config.json)
    processor_cache_bytes: int = 4 << 30  # a VL model: --mm-processor-cache-gb (host memory)

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def estimate(s: Setting) -> dict:
    """The per-device figures of `s`, as plain numbers (the `--json` object)."""
    cfg, tp, pp = s.cfg, s.tensor_parallel_size, s.pipeline_parallel_size
    weights = sizing.weight_bytes_per_device(cfg, s.dtype_bytes, tp, pp, s.quantization, s.expert_dtype_bytes)
    lora = sizing.lora_slot_bytes(cfg, s.max_loras, s.max_lora_rank, s.dtype_bytes, tp)
    per_block = sizing.kv_bytes_per_block(cfg, s.block_size, s.kv_dtype_bytes, tp, pp)
    per_seq = sizing.blocks_per_seq(s.max_model_len, s.block_size)
    layout = kv_layout(cfg, s.max_model_len, pipeline_parallel_size=pp)
    if layout is not None:  # sliding-window KV groups (worker/kv_groups.py): blocks of k layers, and a
        per_block = layout.bytes_per_block(per_block, cfg.num_layers)  # sequence holds its sliding
        per_seq = layout.blocks_held(s.max_model_len, s.block_size)  # groups' windows only
    vision = {} if cfg.vision is None else vision_figures(cfg.vision, s.dtype_bytes, s.max_num_batched_tokens,
                                                          s.max_image_patches, s.processor_cache_bytes)
    if s.gpu is None:
        activations, budget = 0, s.kv_cache_memory or DEFAULT_CPU_KV_BYTES
        allowed = None
    else:
        activations = sizing.activation_bytes_estimate(cfg, s.max_num_batched_tokens, s.max_num_seqs,
                                                       s.dtype_bytes, tp)
        allowed = int(s.gpu.memory_bytes * s.gpu_memory_utilization)
        # the tower and the language model run as separate programs: the larger reserve of the two
        budget = (allowed - weights - vision.get("vision_weights_bytes", 0) - lora
                  - max(activations, vision.get("vision_activation_bytes", 0)))
    blocks = max(0, budget // per_block)
    concurrent = blocks // per_seq
    # the engine's smallest pool: a lone request at its longest (with groups, every table whole)
    fits = concurrent >= 1 and (layout is None or blocks >= layout.min_blocks(s.max_model_len, s.block_size))
    per_token = per_block // s.block_size if layout is None else per_block * per_seq // s.max_model_len
    out = dict(fits=fits, weights_bytes_per_device=weights, lora_bytes=lora, activation_bytes=activations,
               memory_allowed_bytes=allowed, kv_budget_bytes=max(0, budget), kv_bytes_per_block=per_block,
               kv_bytes_per_token=per_token, num_gpu_blocks=blocks, blocks_per_seq=per_seq,
               max_concurrent_seqs=concurrent, running_seqs=min(concurrent, s.max_num_seqs),
               tensor_parallel_size=tp, pipeline_parallel_size=pp, num_devices=s.num_devices,
               quantization=s.quantization, max_model_len=s.max_model_len, block_size=s.block_size,
               stages=sizing.stage_layer_ranges(cfg.num_layers, pp),
               total_params=total_params(cfg) + vision.get("vision_params", 0),
               active_params_per_token=active_params(cfg), **vision,
               kv_groups=layout.describe().removeprefix("; ") if layout is not None else None,
               kv_pool=_latent_pool(cfg, tp))
    if s.gpu is not None:
        out["decode_tokens_per_s_batch1"] = _tokens_per_s(s, weights, out["kv_bytes_per_token"], 1)
        out[f"decode_tokens_per_s_batch{out['running_seqs']}"] = \
            _tokens_per_s(s, weights, out["kv_bytes_per_token"], max(1, out["running_seqs"]))
        out["decode_tokens_per_s_at_max_concurrency"] = out[f"decode_tokens_per_s_batch{out['running_seqs']}"]
    return out


def _latent_pool(cfg: ModelConfig, tp: int) -> str | None:
    """MLA's pool, described: one latent per token and layer, the same on every TP device (vLLM, sglang)."""
    if cfg.mla is None:
        return None
    width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    return f"latent, {width} values per token per layer" + (f", replicated on each of the {tp} TP devices"
                                                             if tp > 1 else "")


def matmul_params(cfg: ModelConfig) -> int:
    """Weights a token multiplies (every matmul; the embedding lookup is not one, a tied LM head is).
    A MoE layer: its router, its top-k experts and its shared expert, not the other experts."""
    layers = sum(_prod(v) for k, v in param_shapes(cfg)["layers"].items() if k in sizing.MATMUL_LEAVES)
    if cfg.moe is not None:
        m, sparse = cfg.moe, cfg.num_layers - len(cfg.moe.dense_layers)
        layers += sparse * cfg.hidden_size * (3 * m.active_intermediate_size + m.num_experts)
    return layers + cfg.hidden_size * cfg.vocab_size


def total_params(cfg: ModelConfig) -> int:
    """Every weight the model holds (the checkpoint's count: a mixed MoE's layers hold only their own kind)."""
    shapes = param_shapes(cfg)
    # the per-layer `sliding` flag (gpt-oss, Gemma) is the engine's, not a checkpoint weight
    n = sum(_prod(v) for k, v in shapes["layers"].items() if k != "sliding")
    if cfg.moe is not None and cfg.moe.dense_layers:
        n -= cfg.num_layers  # the `sparse` flag: the engine's, not a checkpoint weight
    return n + sum(_prod(v) for k, v in shapes.items() if k != "layers")


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token uses, counted as model cards do (Qwen3-30B-A3B: 3.3B): every weight
    but the experts a token is not routed to; a dense model's total."""
    if cfg.moe is None:
        return total_params(cfg)
    m = cfg.moe
    idle = (m.num_experts - m.num_experts_per_tok) * 3 * cfg.hidden_size * m.moe_intermediate_size
    return total_params(cfg) - (cfg.num_layers - len(m.dense_layers)) * idle


def _tokens_per_s(s: Setting, weights: int, kv_per_token: int, batch: int) -> float:
    """Per sequence, at `batch` sequences of max_model_len context each: one step reads this
    device's weights and the batch's KV, or computes 2 FLOPs a weight a token, whichever is slower."""
    gpu = s.gpu
    assert gpu is not None
    read = (weights + batch * s.max_model_len * kv_per_token) / gpu.bandwidth
    peak = gpu.fp8_flops if s.quantization in ("fp8", "int8") and gpu.fp8_flops else gpu.bf16_flops
    compute = 2 * batch * matmul_params(s.cfg) / s.num_devices / peak
    return round(1.0 / (s.pipeline_parallel_size * max(read, compute)), 1)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _valid(cfg: ModelConfig, tp: int, pp: int) -> bool:
    return cfg.num_heads % tp == 0 and pp <= cfg.num_layers


def smallest_parallel(s: Setting) -> Setting | None:
    """The fewest devices (TP before PP at the same count: TP keeps all of them busy) that fit."""
    options = sorted(((tp * pp, pp, tp) for tp in TP_SIZES for pp in PP_SIZES if _valid(s.cfg, tp, pp)))
    for _, pp, tp in options:
        if tp * pp >= s.num_devices and (tp, pp) != (s.tensor_parallel_size, s.pipeline_parallel_size):
            candidate = replace(s, tensor_parallel_size=tp, pipeline_parallel_size=pp)
            if estimate(candidate)["fits"]:
                return candidate
    return None


def smallest_quantization(s: Setting) -> Setting | None:
    """The first of fp8 (8-bit, near lossless) then AWQ (4-bit) that fits on the same devices."""
    if s.quantization in ("awq", "gptq"):
        return None
    for q in QUANT_FALLBACKS:
        if q != s.quantization:
            candidate = replace(s, quantization=q)
            if estimate(candidate)["fits"]:
                return candidate
    return None


def flags(s: Setting) -> str:
    parts = []
    if s.tensor_parallel_size > 1:
        parts.append(f"--tensor-parallel-size {s.tensor_parallel_size}")
    if s.pipeline_parallel_size > 1:
        parts.append(f"--pipeline-parallel-size {s.pipeline_parallel_size}")
    if s.quantization:
        parts.append(f"--quantization {s.quantization}")
    if s.max_loras:
        parts.append(f"--enable-lora --max-loras {s.max_loras} --max-lora-rank {s.max_lora_rank}")
    parts += [f"--max-model-len {s.max_model_len}", f"--gpu-memory-utilization {s.gpu_memory_utilization}"]
    return " ".join(parts)


def setting_dict(s: Setting) -> dict:
    d = asdict(s)
    d.pop("cfg")
    d["gpu"] = s.gpu.name if s.gpu else "cpu"
    return d

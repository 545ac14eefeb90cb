"""`jaxserve plan MODEL --gpu NAME ...`: will this model and these flags fit, before renting anything.

Reads only the model's config (jaxserve/plan/source.py), sizes weights, activation reserve and
the KV pool with the engine's own arithmetic (jaxserve/worker/sizing.py) and prints per device:
weights, activation reserve, KV bytes per token, KV blocks, sequences of --max-model-len that fit
at once, a verdict with the flags to use (or the smallest TP/PP or quantization that fits), and a
rough decode roofline from the GPU's bandwidth. `--json` prints one object. Exit status 0 either way.

    jaxserve plan meta-llama/Llama-3.1-70B-Instruct --gpu A100-80GB --max-model-len 4096
"""

from __future__ import annotations

import argparse
import json

from jaxserve.constants import BLOCK_SIZES
from jaxserve.plan.estimate import Setting, estimate, flags, setting_dict, smallest_parallel, smallest_quantization
from jaxserve.plan.gpus import GPUS, find_gpu
from jaxserve.plan.source import bundled_ids, read_model
from jaxserve.plan.vision import max_image_patches, render_lines as vision_lines
from jaxserve.worker import sizing

QUANTIZATIONS = tuple(sizing.QUANT_SCHEMES)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
DTYPES = ("auto", "bfloat16", "float16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help=f"HF directory, GGUF file, cached hub id or a bundled one ({', '.join(bundled_ids())}); "
                             "default: the default model")
    parser.add_argument("--gpu", required=True, help=f"one of {', '.join(g.name for g in GPUS.values())}, or cpu")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default=None,
                        help="default: the checkpoint's own (config.json quantization_config)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: float32 on cpu, else 16-bit")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                        help="default: the engine's for the platform (auto on a GPU, bfloat16 on a CPU)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: the model's context (capped at 2048 on cpu, as the engine)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None, choices=BLOCK_SIZES,
                        help="default: the engine's for the platform (16 on a GPU, 64 on a CPU)")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV pool on cpu (default 1 GiB)")
    parser.add_argument("--enable-lora", action="store_true", help="reserve LoRA adapter slots (as serve's flag)")
    parser.add_argument("--max-loras", type=int, default=1, help="with --enable-lora: adapter slots (default 1)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="with --enable-lora: every slot's rank")
    parser.add_argument("--mm-processor-kwargs", type=json.loads, default=None, metavar="JSON",
                        help="a vision-language model: as serve's, e.g. '{\"max_pixels\": 1003520}' (the largest "
                             "image, so the encoder budget)")
    parser.add_argument("--mm-processor-cache-gb", type=float, default=4.0,
                        help="a vision-language model: as serve's (host memory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def build_setting(args: argparse.Namespace) -> tuple[Setting, str]:
    """The Setting the flags describe, and where the config came from; ValueError naming a bad flag."""
    sizing.check_gpu_memory_utilization(args.gpu_memory_utilization)
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "max_num_seqs", "max_loras", "max_lora_rank"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}: must be >= 1, got {getattr(args, name)}")
    src = read_model(args.model)
    gpu = find_gpu(args.gpu)
    quant = args.quantization or src.quantization
    if quant is not None and quant not in sizing.QUANT_SCHEMES:
        raise ValueError(f"quantization: the checkpoint's {quant!r} is not one plan can size; "
                         f"pass --quantization one of {QUANTIZATIONS}")
    if args.dtype != "auto":
        width = sizing.dtype_bytes(args.dtype)
    else:
        width = 4 if gpu is None else 2
    kv_cache_dtype = args.kv_cache_dtype or sizing.default_kv_cache_dtype(gpu is None)
    kv_width = width if kv_cache_dtype == "auto" else sizing.dtype_bytes(kv_cache_dtype)
    cfg = src.config
    max_len = args.max_model_len or sizing.default_max_model_len(cfg.max_position_embeddings, gpu is None)
    if max_len < 2:
        raise ValueError(f"max_model_len: must be >= 2, got {max_len}")
    if args.pipeline_parallel_size > cfg.num_layers:
        raise ValueError(f"pipeline_parallel_size: {args.pipeline_parallel_size} stages for {cfg.num_layers} layers")
    tokens = args.max_num_batched_tokens or sizing.default_max_num_batched_tokens(max_len)
    # the engine's CPU default on this host (weights/expert_bits.keeps_bf16_experts): a bfloat16
    # checkpoint's experts stay bfloat16 where the CPU has bfloat16 dots, on one device
    bf16_experts = (gpu is None and args.dtype == "auto" and cfg.moe is not None and quant is None
                    and src.torch_dtype == "bfloat16" and args.tensor_parallel_size == args.pipeline_parallel_size == 1
                    and sizing.default_bf16_dots_from(True) > 0)
    setting = Setting(cfg, gpu, args.tensor_parallel_size, args.pipeline_parallel_size, quant, width, kv_width,
                      max_len, args.gpu_memory_utilization, args.max_num_seqs, tokens,
                      args.block_size or sizing.default_block_size(gpu is None),
                      args.kv_cache_memory, args.max_loras if args.enable_lora else 0, args.max_lora_rank,
                      2 if bf16_experts else None,
                      *_vision_fields(args, src.path, cfg))
    return setting, src.where


def _vision_fields(args: argparse.Namespace, path, cfg) -> tuple[int | None, int]:
    """(the processor's largest image in patches, the processor cache's bytes); a VL flag given to a text-only
    model is a ValueError naming it."""
    kwargs, gb = getattr(args, "mm_processor_kwargs", None), getattr(args, "mm_processor_cache_gb", 4.0)
    if cfg.vision is None:
        for name, value, default in (("mm_processor_kwargs", kwargs, None), ("mm_processor_cache_gb", gb, 4.0)):
            if value != default:
                raise ValueError(f"{name}: does not apply to {cfg.architecture}, a model without images")
        return None, 0
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"mm_processor_kwargs: expected a JSON object such as {{\"max_pixels\": 1003520}}")
    if gb < 0:
        raise ValueError(f"mm_processor_cache_gb: must be >= 0, got {gb}")
    return max_image_patches(path, cfg.vision, kwargs), int(gb * (1 << 30))


def plan(args: argparse.Namespace) -> dict:
    """The --json object: the estimate of the flags' setting, plus suggestions when it does not fit."""
    setting, where = build_setting(args)
    result = {"model": args.model or "SmolLM2-135M-Instruct", "config_source": where, **setting_dict(setting),
              **estimate(setting)}
    result["flags"] = flags(setting)
    result["fp8_weight_only"] = setting.gpu is not None and setting.gpu.fp8_flops is None
    if not result["fits"] and setting.cfg.vision is None:  # a VL model is served on one device, unquantized
        for key, found in (("suggest_parallel", smallest_parallel(setting)),
                           ("suggest_quantization", smallest_quantization(setting))):
            if found is not None:
                e = estimate(found)
                result[key] = {"flags": flags(found), "num_devices": found.num_devices,
                               "weights_bytes_per_device": e["weights_bytes_per_device"],
                               "max_concurrent_seqs": e["max_concurrent_seqs"]}
    return result


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def render(r: dict) -> str:
    tp, pp = r["tensor_parallel_size"], r["pipeline_parallel_size"]
    lines = [f"model   {r['model']}  ({r['config_source']})",
             f"devices {r['num_devices']} x {r['gpu']}  (TP {tp} x PP {pp}; stages {r['stages']})",
             f"params  {r['total_params'] / 1e9:.2f} B, {r['active_params_per_token'] / 1e9:.2f} B active per token",
             f"per device:",
             f"  weights             {_gb(r['weights_bytes_per_device'])}"
             f"{'  (' + r['quantization'] + ')' if r['quantization'] else ''}"
             f"{'  (MoE experts in bfloat16)' if r.get('expert_dtype_bytes') == 2 else ''}",
             f"  activation reserve  {_gb(r['activation_bytes'])}",
             *([f"  LoRA slots          {_gb(r['lora_bytes'])}  ({r['max_loras']} x rank {r['max_lora_rank']})"]
               if r["lora_bytes"] else []),
             *vision_lines(r),
             f"  allowed ({r['gpu_memory_utilization']})    {_gb(r['memory_allowed_bytes'])}",
             f"  KV budget           {_gb(r['kv_budget_bytes'])}",
             f"  KV per token        {r['kv_bytes_per_token']} bytes  ({r['kv_bytes_per_block']} per block of "
             f"{r['block_size']})",
             f"  KV blocks           {r['num_gpu_blocks']}  ({r['blocks_per_seq']} per sequence of "
             f"{r['max_model_len']} tokens)",
             *([f"  KV groups           {r['kv_groups']} (sliding layers hold their window only)"]
               if r.get("kv_groups") else []),
             *([f"  KV pool             {r['kv_pool']}"] if r.get("kv_pool") else []),
             f"  sequences at full context: {r['max_concurrent_seqs']} (running at once: {r['running_seqs']}, "
             f"max_num_seqs {r['max_num_seqs']})"]
    if "decode_tokens_per_s_batch1" in r:
        lines.append(f"decode roofline (per sequence, {r['max_model_len']}-token context): "
                     f"{r['decode_tokens_per_s_batch1']} tok/s at batch 1, "
                     f"{r['decode_tokens_per_s_at_max_concurrency']} tok/s at batch {max(1, r['running_seqs'])}")
    if r["quantization"] == "fp8" and r.get("fp8_weight_only"):
        lines.append(f"note: {r['gpu']} has no FP8 tensor cores: fp8 is weight-only there (memory and bandwidth, "
                     "not FLOPs)")
    if r["fits"]:
        lines.append(f"verdict: FITS -- jaxserve serve {r['model']} {r['flags']}")
    else:
        lines.append("verdict: DOES NOT FIT" + (" (the weights and activations alone exceed the allowed memory)"
                                                if r["kv_budget_bytes"] == 0 else " (no room for one full sequence)"))
        if (r.get("vision_activation_bytes") or 0) > (r["memory_allowed_bytes"] or 0) > 0:
            lines.append("  the vision tower's largest program alone exceeds the allowed memory: the encoder budget "
                         "is the larger of --max-num-batched-tokens x 4 patches and the processor's largest image "
                         "(max_pixels in preprocessor_config.json); lowering it shrinks the program")
        for key, what in (("suggest_parallel", "smallest TP/PP"), ("suggest_quantization", "or quantize")):
            if key in r:
                s = r[key]
                lines.append(f"  {what}: {s['flags']}  ({s['num_devices']} device{'s' if s['num_devices'] > 1 else ''}, weights "
                             f"{_gb(s['weights_bytes_per_device'])}/device, {s['max_concurrent_seqs']} sequences)")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        result = plan(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}")
        return 2
    print(json.dumps(result) if args.json else render(result))
    return 0

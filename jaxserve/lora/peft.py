"""Read a PEFT LoRA adapter directory into per-projection A/B arrays in the model's [in, out] layout.

    adapter_config.json          r, lora_alpha, use_rslora, target_modules, bias, use_dora, ...
    adapter_model.safetensors    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight [r, in]
    (or adapter_model.bin)       ...                                      .lora_B.weight [out, r]

PEFT computes y = x W + (x A^T) B^T * scaling, scaling = lora_alpha / r (use_rslora:
lora_alpha / sqrt(r)). Here A is stored [L, in, r] and B [L, r, out] with the scaling
folded into B, so the step adds (x @ A) @ B and nothing else; layers the adapter does
not touch (layers_to_transform) hold zeros. Everything else PEFT can save is refused
with a ValueError naming the field (the server answers 400).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jaxserve.models.config import ModelConfig

# PEFT / HF module name -> the base model's weight name (models/llama.py)
MODULES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
# fused projections (Phi-3's qkv_proj [q; k; v] and gate_up_proj [gate; up] rows): an adapter on one is
# the same A for each part and B split by the part's rows, which is exactly PEFT's x A^T B^T on the fused output
FUSED = {"qkv_proj": ("wq", "wk", "wv"), "gate_up_proj": ("w_gate", "w_up")}
FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter on the host: module (llama weight name) -> (A [L, in, r], B [L, r, out] * scaling)."""
    rank: int
    scaling: float
    modules: dict[str, tuple[np.ndarray, np.ndarray]]


def module_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every projection an adapter may target."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"wq": (h, nq), "wk": (h, nkv), "wv": (h, nkv), "wo": (nq, h),
            "w_gate": (h, i), "w_up": (h, i), "w_down": (i, h)}


def read_adapter_config(path: str | Path) -> dict:
    """adapter_config.json of a PEFT adapter directory, or a ValueError naming what is wrong."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"lora_path: {str(path)!r} does not exist")
    if not p.is_dir() or not (p / "adapter_config.json").is_file():
        raise ValueError(f"lora_path: {str(path)!r} is not a PEFT adapter directory (no adapter_config.json)")
    try:
        return json.loads((p / "adapter_config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"lora_path: {p / 'adapter_config.json'} is not valid JSON: {e}") from None


def check_adapter_config(conf: dict, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a supported adapter config; ValueError naming the first unsupported field."""
    if conf.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type: only LORA adapters are supported, got {conf.get('peft_type')!r}")
    if conf.get("use_dora"):
        raise ValueError("use_dora: DoRA adapters are not supported")
    if conf.get("modules_to_save"):
        raise ValueError(f"modules_to_save: not supported (the adapter saves {conf['modules_to_save']})")
    if conf.get("bias", "none") != "none":
        raise ValueError(f"bias: only 'none' is supported, got {conf.get('bias')!r}")
    if conf.get("fan_in_fan_out"):
        raise ValueError("fan_in_fan_out: not supported for this model's linear layers")
    for key in ("rank_pattern", "alpha_pattern"):
        if conf.get(key):
            raise ValueError(f"{key}: per-module ranks or alphas are not supported")
    rank, alpha = conf.get("r"), conf.get("lora_alpha", 8)
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"r: must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"r: the adapter's rank {rank} is above --max-lora-rank {max_lora_rank}")
    scaling = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    targets = conf.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted(set(targets) - set(MODULES) - set(FUSED))
        if unknown:
            raise ValueError(f"target_modules: {unknown} are not projections of this model "
                             f"(supported: {sorted(MODULES)})")
    return rank, float(scaling)


def _read_tensors(p: Path) -> dict[str, np.ndarray]:
    st, bin_ = p / "adapter_model.safetensors", p / "adapter_model.bin"
    if st.is_file():  # the safetensors library, as the model loader reads (numpy: host arrays, no compile)
        try:
            with safe_open(str(st), framework="numpy") as f:
                return {name: f.get_tensor(name).astype(np.float32) for name in f.keys()}
        except Exception as e:  # (safetensors raises its own error types for a corrupt file)
            raise ValueError(f"lora_path: cannot read {st} ({e})") from None
    if bin_.is_file():
        import torch

        state = torch.load(str(bin_), map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state.items()}
    raise ValueError(f"lora_path: {str(p)!r} has no adapter_model.safetensors or adapter_model.bin")


def _split_fused(parts: tuple[str, ...], layer: int, ab: str, value: np.ndarray, dims: dict[str, tuple[int, int]],
                 key: str) -> dict[tuple[str, int, str], np.ndarray]:
    """A fused projection's lora_A (shared by its parts) or lora_B (split by the parts' output rows)."""
    if ab == "A":
        return {(part, layer, "A"): value for part in parts}
    rows = [dims[part][1] for part in parts]
    if value.ndim != 2 or value.shape[0] != sum(rows):
        raise ValueError(f"r: {key!r} has shape {value.shape}; the fused projection has {sum(rows)} output rows")
    bounds = np.cumsum([0, *rows])
    return {(part, layer, "B"): value[lo:hi] for part, lo, hi in zip(parts, bounds[:-1], bounds[1:])}


def load_adapter(path: str | Path, cfg: ModelConfig, max_lora_rank: int) -> LoRAWeights:
    """Read and check a PEFT adapter for the model `cfg`; ValueError naming the field on anything unsupported."""
    conf = read_adapter_config(path)
    rank, scaling = check_adapter_config(conf, max_lora_rank)
    tensors = _read_tensors(Path(path).expanduser())
    dims = module_dims(cfg)
    found: dict[tuple[str, int, str], np.ndarray] = {}
    fused = cfg.architecture in FUSED_ARCHITECTURES
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in (set(MODULES) | (set(FUSED) if fused else set())):
            raise ValueError(f"target_modules: the adapter's tensor {key!r} targets a module this model lacks")
        layer, ab = int(m.group(1)), m.group(3)
        if layer >= cfg.num_layers:
            raise ValueError(f"target_modules: {key!r} is for layer {layer}; the model has {cfg.num_layers}")
        if m.group(2) in FUSED:
            found.update(_split_fused(FUSED[m.group(2)], layer, ab, value, dims, key))
        else:
            found[(MODULES[m.group(2)], layer, ab)] = value
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module in sorted({k[0] for k in found}):
        n_in, n_out = dims[module]
        a = np.zeros((cfg.num_layers, n_in, rank), np.float32)
        b = np.zeros((cfg.num_layers, rank, n_out), np.float32)
        for layer in range(cfg.num_layers):
            la, lb = found.get((module, layer, "A")), found.get((module, layer, "B"))
            if (la is None) != (lb is None):
                raise ValueError(f"target_modules: layer {layer} {module} has only one of lora_A, lora_B")
            if la is None:
                continue
            if la.shape != (rank, n_in) or lb.shape != (n_out, rank):
                raise ValueError(f"r: layer {layer} {module}: lora_A {la.shape} / lora_B {lb.shape} do not match "
                                 f"r={rank} and the base model's projection ({n_in} -> {n_out})")
            a[layer], b[layer] = la.T, lb.T * scaling
        modules[module] = (a, b)
    if not modules:
        raise ValueError(f"lora_path: {str(path)!r} holds no LoRA weights")
    return LoRAWeights(rank, scaling, modules)

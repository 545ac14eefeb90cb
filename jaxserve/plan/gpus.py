"""The accelerators `jaxserve plan` knows: memory, HBM bandwidth and peak dense tensor-core FLOP/s.

Memory is what `nvidia-smi` reports as the total (MiB x 2**20), not the marketing GB; bandwidth
and FLOP/s are the vendors' datasheet figures (dense, no 2:4 sparsity). `fp8_flops` is None where
the chip has no FP8 tensor cores (Ampere): FP8 weights there are weight-only (dequantized to
16-bit for the dot), so they save memory and bandwidth but not FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    bandwidth: float  # bytes/s of device memory
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float | None


GPUS: dict[str, Gpu] = {g.name.lower(): g for g in (
    Gpu("A100-40GB", 40960 * MIB, 1555e9, 312e12, None),
    Gpu("A100-80GB", 81920 * MIB, 2039e9, 312e12, None),
    Gpu("H100", 81559 * MIB, 3350e9, 989e12, 1979e12),  # SXM5 80 GB
    Gpu("H100-PCIe", 81559 * MIB, 2000e9, 756e12, 1513e12),
    Gpu("H200", 143771 * MIB, 4800e9, 989e12, 1979e12),
    Gpu("L40S", 46068 * MIB, 864e9, 362e12, 733e12),
    Gpu("L4", 23034 * MIB, 300e9, 121e12, 242e12),
    Gpu("RTX-4090", 24564 * MIB, 1008e9, 165e12, 330e12),
    Gpu("A10", 23028 * MIB, 600e9, 125e12, None),
)}
ALIASES = {"a100": "a100-80gb", "a100-80g": "a100-80gb", "a100-40g": "a100-40gb", "h100-sxm": "h100",
           "h100-80gb": "h100", "h100-sxm-80gb": "h100", "rtx4090": "rtx-4090", "4090": "rtx-4090",
           "a10g": "a10"}
CPU = "cpu"  # the host: the KV pool is --kv-cache-memory bytes, as the engine on a CPU


def find_gpu(name: str) -> Gpu | None:
    """The table entry for `name` (case, spaces and underscores ignored); None for `cpu`."""
    key = name.strip().lower().replace(" ", "-").replace("_", "-")
    if key == CPU:
        return None
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise ValueError(f"gpu: unknown {name!r}; known: {', '.join(g.name for g in GPUS.values())}, {CPU}")
    return GPUS[key]

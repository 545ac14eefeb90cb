"""`jaxserve convert MODEL OUT`: write an Orbax checkpoint that loads faster than its source.

A GGUF must be parsed and dequantized and an HF directory transposed and
stacked on every load; the checkpoint stores the params exactly as the model
consumes them (stacked, [in, out], in the --dtype given, uncompressed), plus
the config and the tokenizer files.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import Params
from jaxserve.weights.loader import CHECKPOINT_MARKER, load_model, read_checkpoint_marker

FORMAT_VERSION = 1


def check_output_dir(out: Path) -> None:
    """Refuse to write into anything but a missing or empty directory (never mix two checkpoints)."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: output path exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"{out}: output directory exists and is not empty; "
                              "pass a new or empty directory")


def save_checkpoint(out: Path, cfg: ModelConfig, params: Params, tokenizer) -> None:
    out = out.resolve()
    check_output_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    # Uncompressed: zstd-decoding the default float32 checkpoint cost ~2x the CPU time of reading
    # 1.5x the bytes (BENCHMARKS.md), and load time is what the checkpoint is for.
    with ocp.PyTreeCheckpointer(use_compression=False) as ckpt:
        ckpt.save(out / "params", args=ocp.args.PyTreeSave(params))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    marker = {"format_version": FORMAT_VERSION, "config": cfg.to_dict()}
    (out / CHECKPOINT_MARKER).write_text(json.dumps(marker, indent=2))


def load_checkpoint(path: Path, dtype: jnp.dtype) -> tuple[ModelConfig, Params]:
    marker = read_checkpoint_marker(path)
    if marker.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path / CHECKPOINT_MARKER}: unsupported format_version {marker.get('format_version')!r}")
    cfg = ModelConfig.from_dict(marker["config"])
    # Restore into an explicit target: straight to this process's first device (the saved sharding
    # names the device it was converted on, e.g. cpu:0) and in the requested dtype (cast on read).
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    with ocp.StandardCheckpointer() as ckpt:
        saved = ckpt.metadata(path.resolve() / "params").item_metadata.tree
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, dtype, sharding=sharding), saved)
        params = ckpt.restore(path.resolve() / "params", target)
    return cfg, params


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="write an Orbax checkpoint of MODEL to OUT (loads faster)")
    p.add_argument("model", help="a .gguf file, an HF-format directory or a cached hub id")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        check_output_dir(Path(args.out))  # before the (slow) load, not after it
        loaded = load_model(args.model, args.dtype)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"jaxserve convert: error: {e}", file=sys.stderr)
        return 1
    t1 = time.perf_counter()
    save_checkpoint(Path(args.out), loaded.config, loaded.params, loaded.tokenizer)
    t2 = time.perf_counter()
    print(f"loaded {loaded.path} in {t1 - t0:.2f}s, wrote {args.out} in {t2 - t1:.2f}s")
    return 0

"""`jaxserve convert MODEL OUT`: write an Orbax checkpoint that loads faster than its source.

A GGUF must be dequantized and an HF directory transposed and stacked on every
load; the checkpoint stores the params exactly as the model consumes them
(stacked, [in, out]), plus the config and the tokenizer files.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import Params
from jaxserve.weights.loader import CHECKPOINT_MARKER, load_model, read_checkpoint_marker

FORMAT_VERSION = 1


def save_checkpoint(out: Path, cfg: ModelConfig, params: Params, tokenizer) -> None:
    out = out.resolve()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: output directory exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out / "params", params)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    marker = {"format_version": FORMAT_VERSION, "config": cfg.to_dict()}
    (out / CHECKPOINT_MARKER).write_text(json.dumps(marker, indent=2))


def load_checkpoint(path: Path, dtype: jnp.dtype) -> tuple[ModelConfig, Params]:
    marker = read_checkpoint_marker(path)
    if marker.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path / CHECKPOINT_MARKER}: unsupported format_version {marker.get('format_version')!r}")
    cfg = ModelConfig.from_dict(marker["config"])
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(path.resolve() / "params")
    return cfg, jax.tree.map(lambda a: jnp.asarray(a, dtype), params)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="write an Orbax checkpoint of MODEL to OUT (loads faster)")
    p.add_argument("model", help="a .gguf file, an HF-format directory or a cached hub id")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    loaded = load_model(args.model, args.dtype)
    t1 = time.perf_counter()
    save_checkpoint(Path(args.out), loaded.config, loaded.params, loaded.tokenizer)
    t2 = time.perf_counter()
    print(f"loaded {loaded.path} in {t1 - t0:.2f}s, wrote {args.out} in {t2 - t1:.2f}s")
    return 0

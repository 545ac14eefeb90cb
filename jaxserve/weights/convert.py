"""`jaxserve convert MODEL OUT`: write an Orbax checkpoint that loads faster than its source.

A GGUF must be parsed and dequantized and an HF directory transposed and
stacked on every load; the checkpoint stores the params exactly as the model
consumes them (stacked, [in, out], in the --dtype given, uncompressed), plus
the config and the tokenizer files.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# the format's functions live in checkpoint.py (still importable from here)
from jaxserve.weights.checkpoint import (FORMAT_VERSION, check_output_dir, load_checkpoint,  # noqa: F401
                                         load_checkpoint_params, save_checkpoint)
from jaxserve.weights.loader import load_model


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

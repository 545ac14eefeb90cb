"""The Orbax checkpoint `jaxserve convert` writes: params stored exactly as the model consumes them
(stacked, [in, out], in the --dtype given, uncompressed), plus the config (in the marker file that
source.py recognises) and the tokenizer files. convert.py is the command; this is the format."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import Params
from jaxserve.weights.source import CHECKPOINT_FORMAT_VERSION, CHECKPOINT_MARKER, describe_path

FORMAT_VERSION = CHECKPOINT_FORMAT_VERSION


def check_output_dir(out: Path) -> None:
    """Refuse to write into anything but a missing or empty directory (never mix two checkpoints)."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: output path exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"{out}: output directory exists and is not empty; "
                              "pass a new or empty directory")


def save_checkpoint(out: Path, cfg: ModelConfig, params: Params, tokenizer) -> None:
    import orbax.checkpoint as ocp  # here: a second of start-up that other formats do not need

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
    """The checkpoint's config (source.py's reading of its marker, format_version checked) and params."""
    return describe_path(path, str(path)).config, load_checkpoint_params(path, dtype)


def load_checkpoint_params(path: Path, dtype: jnp.dtype) -> Params:
    import orbax.checkpoint as ocp

    # Restore into an explicit target: straight to this process's first device (the saved sharding
    # names the device it was converted on, e.g. cpu:0) and in the requested dtype (cast on read).
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    with ocp.StandardCheckpointer() as ckpt:
        saved = ckpt.metadata(path.resolve() / "params").item_metadata.tree
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, dtype, sharding=sharding), saved)
        return ckpt.restore(path.resolve() / "params", target)

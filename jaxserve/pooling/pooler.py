"""sentence-transformers' pipeline after the transformer, as it computes it: the Pooling module over the
hidden rows, then Dense (with its activation) and Normalize on the host.

    hidden [B, S, H], lengths [B] --pool_hidden (jnp; the padded encoder runner)--> raw rows [B, H]
    one request's rows [n, H]     --pool_rows (numpy; the paged runner)----------> raw row [H]
    raw row --Pooler.postprocess (numpy: Dense, Normalize in modules.json's order)--> embedding

The device returns the raw pooled row (classify: the head's logits); everything after pooling runs
here, in float64 on the host (a [H] x [H, D] product per request: microseconds beside the step).
A Matryoshka `dimensions` cut comes after this (io.embedding), as in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.pooling.config import POOLING_TYPES, PoolingModelInfo, read_json

RowsNeeded = Literal["first", "last", "all"]


def rows_needed(mode: str) -> RowsNeeded:
    """Which of a request's hidden rows `mode` reads, so the paged runner fetches only those."""
    _check_mode(mode)
    return {"CLS": "first", "LAST": "last"}.get(mode, "all")


def _check_mode(mode: str) -> None:
    if mode not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {mode!r}")


def pool_hidden(hidden: jax.Array, lengths: jax.Array, mode: str) -> jax.Array:
    """hidden [B, S, H] (right-padded), lengths [B] -> [B, H] float32, sentence-transformers' formulas:
    CLS the first token, LAST the last real one, MEAN / MEAN_SQRT_LEN_TOKENS the sum over real tokens
    divided by n / sqrt(n), MAX the largest value over real tokens, WEIGHTEDMEAN the mean with
    position i (1-based) weighted by i. A padding row (length 0) pools to zeros."""
    _check_mode(mode)
    hidden = hidden.astype(jnp.float32)
    if mode == "CLS":
        return hidden[:, 0]
    if mode == "LAST":
        return jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    mask = jnp.arange(hidden.shape[1])[None, :] < lengths[:, None]  # [B, S]
    if mode == "MAX":
        out = jnp.where(mask[..., None], hidden, -jnp.inf).max(axis=1)
        return jnp.where((lengths > 0)[:, None], out, 0.0)
    weights = mask.astype(jnp.float32)
    if mode == "WEIGHTEDMEAN":
        weights = weights * jnp.arange(1, hidden.shape[1] + 1, dtype=jnp.float32)[None, :]
    total = jnp.einsum("bs,bsh->bh", weights, hidden)
    count = jnp.maximum(weights.sum(axis=1, keepdims=True), 1e-9)
    return total / (jnp.sqrt(count) if mode == "MEAN_SQRT_LEN_TOKENS" else count)


def pool_rows(rows: np.ndarray, mode: str) -> np.ndarray:
    """One request's hidden rows [n, H] -> [H] float32, pool_hidden's formulas. For CLS / LAST the rows
    may be just the one rows_needed() names (the first / last row is read either way)."""
    _check_mode(mode)
    rows = np.asarray(rows, np.float32)
    if rows.ndim != 2 or rows.shape[0] == 0:
        raise ValueError(f"pool_rows: expected rows [n >= 1, H], got shape {rows.shape}")
    if mode == "CLS":
        return rows[0].copy()
    if mode == "LAST":
        return rows[-1].copy()
    if mode == "MAX":
        return rows.max(axis=0)
    weights = np.ones(rows.shape[0], np.float64)
    if mode == "WEIGHTEDMEAN":
        weights = np.arange(1, rows.shape[0] + 1, dtype=np.float64)
    total = weights @ rows.astype(np.float64)
    count = weights.sum()
    return (total / (math.sqrt(count) if mode == "MEAN_SQRT_LEN_TOKENS" else count)).astype(np.float32)


def _gelu(x: np.ndarray) -> np.ndarray:  # torch.nn.GELU()'s default: the exact erf form
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


# torch.nn activations sentence-transformers' Dense saves (by class name; it builds them with no arguments)
ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Identity": lambda x: x, "Tanh": np.tanh, "Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "ReLU": lambda x: np.maximum(x, 0.0), "GELU": _gelu, "SiLU": lambda x: x / (1.0 + np.exp(-x)),
    "LeakyReLU": lambda x: np.where(x >= 0, x, 0.01 * x), "Softplus": lambda x: np.logaddexp(0.0, x)}


@dataclass(frozen=True, eq=False)
class Dense:
    """sentence-transformers' Dense: activation(x W^T + b) (+ x, or + x R^T, with use_residual)."""
    weight: np.ndarray  # [out, in] float64
    bias: np.ndarray | None  # [out]
    activation: str  # a key of ACTIVATIONS
    use_residual: bool = False
    residual: np.ndarray | None = None  # [out, in] when in != out and use_residual

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        y = ACTIVATIONS[self.activation](y)
        if self.use_residual:
            y = y + (x if self.residual is None else x @ self.residual.T)
        return y


def _normalize(x: np.ndarray) -> np.ndarray:  # torch.nn.functional.normalize: x / max(||x||, 1e-12)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _read_weights(folder: Path) -> dict[str, np.ndarray]:
    """A module folder's weights: model.safetensors (sentence-transformers' default since 3.0), or the
    older pytorch_model.bin, which only torch can read."""
    if (folder / "model.safetensors").is_file():
        from jaxserve.weights.safetensors_dir import tensor_reader

        get, names = tensor_reader(folder)
        return {name: np.asarray(get(name), np.float64) for name in names}
    pickle = folder / "pytorch_model.bin"
    if not pickle.is_file():
        raise ValueError(f"{folder}: no model.safetensors or pytorch_model.bin for this Dense module")
    try:
        import torch
    except ImportError:
        raise ValueError(f"{pickle}: a PyTorch pickle, which needs torch to read, and torch is not installed; "
                         "install torch, or save the module as model.safetensors") from None
    state = torch.load(str(pickle), map_location="cpu", weights_only=True)
    return {name: t.detach().to(torch.float64).numpy() for name, t in state.items()}


def load_dense(folder: Path, in_features: int) -> Dense:
    """One Dense module from its folder (config.json + weights), checked against the width it takes."""
    cfg = read_json(folder / "config.json")
    act_path = str(cfg.get("activation_function") or "torch.nn.modules.activation.Tanh")  # Dense's default
    act = act_path.rsplit(".", 1)[-1]
    if not act_path.startswith("torch.") or act not in ACTIVATIONS:
        raise ValueError(f"{folder}/config.json: activation_function {act_path!r} is not supported; "
                         f"supported: torch.nn's {', '.join(ACTIVATIONS)}")
    weights = _read_weights(folder)
    if "linear.weight" not in weights:
        raise ValueError(f"{folder}: no tensor 'linear.weight' (got {sorted(weights)})")
    w = weights["linear.weight"]
    if w.ndim != 2 or (in_features and w.shape[1] != in_features):
        raise ValueError(f"{folder}: linear.weight has shape {list(w.shape)}; this Dense takes {in_features} "
                         "features (the pooled width, or the previous Dense's output)")
    bias = weights.get("linear.bias") if cfg.get("bias", True) else None
    residual = bool(cfg.get("use_residual", False))
    proj = weights.get("residual.weight") if residual and w.shape[0] != w.shape[1] else None
    if residual and w.shape[0] != w.shape[1] and proj is None:
        raise ValueError(f"{folder}: use_residual with {w.shape[1]} -> {w.shape[0]} needs 'residual.weight'")
    return Dense(w, bias, act, residual, proj)


class Pooler:
    """Everything after pooling, for one model: `postprocess(raw row) -> embedding` (also its __call__)."""

    def __init__(self, steps: tuple[Dense | str, ...], hidden_size: int) -> None:
        self.steps = steps  # Dense modules and "Normalize", in order
        dense = [s for s in steps if isinstance(s, Dense)]
        self.out_features: int | None = int(dense[-1].weight.shape[0]) if dense else None  # the last Dense's
        self.out_dim = self.out_features or hidden_size  # the embedding's width

    @classmethod
    def from_model_dir(cls, model_dir: Path, info: PoolingModelInfo, hidden_size: int | None = None) -> "Pooler":
        """The Dense / Normalize modules of modules.json (embed task), with the pooler config's
        normalize deciding (--override-pooler-config can drop or add the Normalize). Classify: none.
        hidden_size: the pooled width (config.json's hidden_size when None), checked against the
        first Dense's input at start-up."""
        if hidden_size is None:
            hidden_size = int(read_json(Path(model_dir) / "config.json").get("hidden_size") or 0)
        if info.task != "embed":
            return cls((), hidden_size)
        steps: list[Dense | str] = []
        width = hidden_size
        for kind, folder in info.st_modules:
            if kind == "Dense":
                steps.append(load_dense(Path(model_dir) / folder, width))
                width = steps[-1].weight.shape[0]
            elif kind == "Normalize" and info.pooler.normalize:
                steps.append("Normalize")
        if info.pooler.normalize and "Normalize" not in steps:
            steps.append("Normalize")
        return cls(tuple(steps), hidden_size)

    def dimension(self, hidden_size: int) -> int:
        """The embedding's width: the last Dense's out_features, else the model's hidden size."""
        return self.out_features or hidden_size

    def postprocess(self, row: np.ndarray) -> np.ndarray:
        """A raw pooled row [H] (or rows [B, H]) -> the embedding, float32."""
        x = np.asarray(row, np.float64)
        for step in self.steps:
            x = _normalize(x) if isinstance(step, str) else step(x)
        return x.astype(np.float32)

    __call__ = postprocess


def post_processor(model_dir: Path, info: PoolingModelInfo, hidden_size: int | None = None) -> Pooler:
    """The model directory's post-processing (Pooler.from_model_dir), built once at start-up."""
    return Pooler.from_model_dir(model_dir, info, hidden_size)

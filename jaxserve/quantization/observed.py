"""`Observed`: a weight leaf that reports its input's statistics when `matmul` multiplies by it.

A weight type like `QuantizedWeight`, below the model: `matmul` (quantization/matmul.py) knows
it, and calibrate.py wraps a model's weights in it to measure the activations through the
model's own forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Observed:
    weight: jax.Array  # [..., K, N] float
    name: str = field(metadata=dict(static=True))
    sink: Callable[[str, np.ndarray], None] = field(metadata=dict(static=True))


def observe(x: jax.Array, w: Observed) -> None:
    """Send max |x| over the tokens ([K] float32) to the weight's sink."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)).reshape(-1, x.shape[-1]), axis=0)
    jax.debug.callback(lambda a: w.sink(w.name, np.asarray(a)), amax, ordered=True)

"""When each request of a load is sent (shared by bench serve's generation and pooling loads)."""

from __future__ import annotations

import math

import numpy as np


def arrival_delays(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from start): a Poisson process (gamma intervals with shape `burstiness`); all 0 at inf."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0
    return list(np.cumsum(gaps))

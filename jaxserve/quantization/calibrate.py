"""Activation statistics for calibration, measured by running `llama.forward` itself.

Each matmul weight is wrapped in an `Observed` leaf; `matmul` multiplies by the
wrapped weight as usual and reports the per-channel max |x| of its input to the
`sink` through an ordered `jax.debug.callback`. The layer scan calls every leaf
once per layer, in order, so the sink receives one row per layer. No second copy
of the decoder is needed, and whatever the model does (biases, q/k norms, sliding
windows, the paged attention) is what is measured.
"""

from __future__ import annotations

from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import llama
from jaxserve.models.attention import AttentionMetadata, make_kv_cache
from jaxserve.models.config import ModelConfig
from jaxserve.quantization.observed import Observed, observe  # noqa: F401  (the leaf type, below the model)

# which weight's input stands for each statistic (wq, wk, wv share theirs; so do w_gate and w_up)
OBSERVED_LEAVES = {"wq": "qkv", "wo": "o", "w_gate": "gate_up", "w_down": "down"}


class _Collector:
    def __init__(self) -> None:
        self.rows: dict[str, list[np.ndarray]] = defaultdict(list)

    def __call__(self, name: str, amax: np.ndarray) -> None:
        self.rows[name].append(amax)


def activation_absmax(params: dict, cfg: ModelConfig, token_ids: np.ndarray) -> dict[str, jax.Array]:
    """Per-channel max |x| of every matmul input over one causal sequence, through llama.forward.

    Returns {"qkv": [L, hidden], "o": [L, nq*hd], "gate_up": [L, hidden], "down": [L, inter],
    "head": [hidden]}.
    """
    sink = _Collector()
    layers = {k: Observed(v, OBSERVED_LEAVES[k], sink) if k in OBSERVED_LEAVES else v
              for k, v in params["layers"].items()}
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    observed = {**params, "layers": layers, "lm_head": Observed(head, "head", sink)}
    num_tokens, block_size = len(token_ids), 16
    num_blocks = -(-num_tokens // block_size)
    kv = make_kv_cache(cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim,
                       params["embed"].dtype)
    md = AttentionMetadata(slot_mapping=jnp.arange(num_tokens, dtype=jnp.int32),
                           kv_lens=jnp.asarray([num_tokens], jnp.int32),
                           block_tables=jnp.arange(num_blocks, dtype=jnp.int32)[None],
                           cu_q_lens=jnp.asarray([0, num_tokens], jnp.int32),
                           num_seqs=jnp.asarray([1], jnp.int32))
    ids = jnp.asarray(token_ids, jnp.int32)
    _, hidden = llama.forward(observed, cfg, kv, ids, jnp.arange(num_tokens, dtype=jnp.int32), md)
    jax.block_until_ready(llama.compute_logits(observed, hidden))
    jax.effects_barrier()
    out = {name: jnp.asarray(np.stack(rows)) for name, rows in sink.rows.items()}
    out["head"] = out["head"][0]
    return out

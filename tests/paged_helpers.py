"""Drive the model over the paged KV cache by hand (no engine): a ragged prefill of
several sequences, then batched decode steps, each through the jitted forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import llama
from jaxserve.models.attention import AttentionMetadata, make_kv_cache
from jaxserve.models.config import ModelConfig


def _metadata(seq_blocks, kv_lens, q_lens, slots, max_blocks):
    n = len(kv_lens)
    tables = np.zeros((n, max_blocks), np.int32)
    for i, b in enumerate(seq_blocks):
        tables[i, : len(b)] = b
    return AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        block_tables=jnp.asarray(tables),
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        num_seqs=jnp.asarray([n], jnp.int32),
    )


def paged_logits(params, cfg: ModelConfig, prompts: list[list[int]], continuations: list[list[int]],
                 block_size: int = 4, num_blocks: int = 64, backend: str = "xla", kv_dtype=None):
    """Logits [seq][position] for the last prompt token and each teacher-forced continuation token.

    Blocks are handed out in a scrambled order (and block 0 holds garbage) so that a
    kernel reading the wrong block or past kv_len shows up as a mismatch.
    """
    kv = make_kv_cache(cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim,
                       kv_dtype or params["embed"].dtype)
    kv = (kv[0].at[:, :, 0].set(1e4), kv[1].at[:, :, 0].set(-1e4))
    free = list(np.random.default_rng(0).permutation(np.arange(1, num_blocks)))
    blocks: list[list[int]] = [[] for _ in prompts]
    lens = [0] * len(prompts)
    max_blocks = num_blocks // len(prompts)
    step = jax.jit(lambda p, kv, t, pos, md, idx: _step(p, cfg, kv, t, pos, md, idx, backend), donate_argnums=1)

    def run(new_tokens: list[list[int]]):
        nonlocal kv
        toks, pos, slots, q_lens = [], [], [], []
        for i, new in enumerate(new_tokens):
            for t in new:
                if lens[i] % block_size == 0:
                    blocks[i].append(int(free.pop()))
                slots.append(blocks[i][-1] * block_size + lens[i] % block_size)
                toks.append(t)
                pos.append(lens[i])
                lens[i] += 1
            q_lens.append(len(new))
        md = _metadata(blocks, lens, q_lens, slots, max_blocks)
        last = np.cumsum(q_lens) - 1
        kv, logits = step(params, kv, jnp.asarray(toks, jnp.int32), jnp.asarray(pos, jnp.int32), md,
                          jnp.asarray(last, jnp.int32))
        return np.asarray(logits)

    out = [[row] for row in run(prompts)]
    for j in range(max(len(c) for c in continuations)):
        rows = run([[c[j]] for c in continuations])
        for i in range(len(prompts)):
            out[i].append(rows[i])
    return [np.stack(o) for o in out]


def _step(params, cfg, kv, tokens, positions, md, last_idx, backend):
    kv, hidden = llama.forward(params, cfg, kv, tokens, positions, md, backend)
    return kv, llama.compute_logits(params, hidden[last_idx])

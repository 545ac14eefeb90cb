"""`--batch-invariant` (vLLM's VLLM_BATCH_INVARIANT): a token's logprob is bitwise the same whatever
batch, bucket or prefill chunking it is computed in.

Where the CPU (XLA:CPU) path depends on the batch, and what this mode does about each:

- Matmuls by row count M. XLA:CPU takes one of two dot paths by M, and they sum K in different
  orders: M = 1 and M >= 64 agree bit for bit (every row, whatever the other rows hold); M = 2-56
  differ from them, and 40-56 from 2-32 (measured at the default model's 576 x 1536, 1536 x 576,
  576 x 4096 shapes; bfloat16 dots: M >= 2 all agree). So every token bucket and every sampler
  bucket here is at least MIN_ROWS: each projection, the LM head and the sampler see M >= 64.
- Attention by chunking. The XLA attention (pallas_kernels.attend_reference) takes a step's own
  new keys in tiles of the step and the cached keys block by block, with a different summation
  for a run of new tokens; how a prompt is chunked, or whether a token is decoded or prefilled,
  changes which keys fall in which part. Here every token is its own one-token sequence of the
  step (`per_token_attention`): its own key from the pool as a decode's, every earlier key
  gathered from its blocks in the same fixed order, whatever else the step holds.
- The sampler's sliced greedy head (vocab_slices) is chosen per batch (a lax.cond over every
  row's settings): off, the whole head for every row.
- bfloat16 dots from a token count on (the CPU's --dtype auto): every bucket is past it, so
  every step takes them (or none does).

What it cannot honour is refused at start-up (`refusal`): the Pallas (GPU) kernels, whose grids
split by batch; tensor / pipeline parallelism and several hosts (not verified here); quantized
weights (their activation scaling paths are not verified); LoRA slots; mixture-of-experts layers
(tokens are grouped by expert across the batch).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxserve.worker.input_batch import StepInput

MIN_ROWS = 64  # the smallest M of every dot in this mode (see the module docstring)


def enabled(flag: bool) -> bool:
    """The flag, or vLLM's environment variable VLLM_BATCH_INVARIANT=1."""
    return flag or os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1"


def refusal(args, attention_backend: str) -> str | None:
    """Why this engine cannot be batch-invariant (a ValueError's message naming the flag), or None."""
    why = None
    if attention_backend != "xla":
        why = f"attention_backend {attention_backend} (its kernels split work by batch); use the xla backend"
    elif (args.tensor_parallel_size, args.pipeline_parallel_size, args.num_hosts) != (1, 1, 1):
        why = "tensor_parallel_size, pipeline_parallel_size and num_hosts must be 1"
    elif args.quantization is not None:
        why = f"quantization {args.quantization} is not supported"
    elif args.enable_lora:
        why = "enable_lora is not supported"
    return None if why is None else f"batch_invariant (or VLLM_BATCH_INVARIANT=1): {why}"


def grid(buckets: list[int]) -> list[int]:
    """A bucket grid with every bucket below MIN_ROWS dropped (MIN_ROWS alone when none is left)."""
    kept = [b for b in buckets if b >= MIN_ROWS]
    return kept or [MIN_ROWS]


def per_token_attention(batch: StepInput, rows: int) -> StepInput:
    """The same step with every real token its own one-token sequence (host numpy): kv_lens its
    position + 1, its sequence's block table, cu_q_lens 0, 1, ..., n; `rows` (the largest token
    bucket) rows, so every step of a bucket has one shape. The tokens' K/V are written to the
    pool before attention reads it, so a token reads its own and every earlier key from the pool."""
    md = batch.attn
    cu = np.asarray(md.cu_q_lens, np.int32)
    kv_lens = np.asarray(md.kv_lens, np.int32)
    num_seqs = int(np.asarray(md.num_seqs).reshape(-1)[0])
    q_lens = np.diff(cu[: num_seqs + 1])
    seq = np.repeat(np.arange(num_seqs), q_lens)  # each real token's sequence
    real = len(seq)
    pos = kv_lens[seq] - q_lens[seq] + (np.arange(real) - cu[seq])  # as pallas_kernels.token_positions
    new_kv = np.zeros(rows, np.int32)
    new_kv[:real] = pos + 1
    tables = np.zeros((rows, np.shape(md.block_tables)[1]), np.int32)
    tables[:real] = np.asarray(md.block_tables)[seq]
    attn = dataclasses.replace(md, kv_lens=new_kv, block_tables=tables,
                               cu_q_lens=np.minimum(np.arange(rows + 1), real).astype(np.int32),
                               num_seqs=np.array([real], np.int32))
    return dataclasses.replace(batch, attn=attn)

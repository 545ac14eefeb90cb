"""Batching of pooling requests (no JAX): each step takes whole prompts, holds nothing afterwards.

A pooling request is prefill-only: one step computes it and it is done, so there are no KV blocks,
no decode and no preemption. What matters is padding: a step runs a [B, S] program (B, S from the
buckets in engine.py), so the waiting prompts are sorted by length and cut into runs whose padded
size fits the token budget; the run holding the oldest request goes first (no starvation).

    waiting (arrival order) --sort by length--> [a a b b b c c d] --cut--> [a a b b][b c c][d]
                                                                 the oldest request's run -> step
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PoolingRequest:
    request_id: str
    token_ids: list[int]
    type_ids: list[int] | None = None  # the segment of each token (a text pair), None: all 0
    arrival: int = 0  # admission order


@dataclass(frozen=True)
class PoolingBatch:
    requests: list[PoolingRequest]
    num_rows: int  # B: the batch bucket
    seq_len: int  # S: the length bucket


def power_buckets(largest: int, factor: int = 2) -> tuple[int, ...]:
    """1, factor, factor**2, ... and then largest itself."""
    out, b = [], 1
    while b < largest:
        out.append(b)
        b *= factor
    return tuple(out + [largest])


def length_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """smallest, 1.5x, 2x, 3x, 4x, ... (each power of two and the midpoint above it), then largest: a
    padded length wastes at most a third of a step (powers of two alone: up to half)."""
    out, b = [], smallest
    while b < largest:
        out.append(b)
        if b * 3 // 2 < largest and (b * 3) % 2 == 0:
            out.append(b * 3 // 2)
        b *= 2
    return tuple(out + [largest])


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} is past the largest bucket {buckets[-1]}")


@dataclass
class PoolingScheduler:
    max_num_seqs: int
    max_num_batched_tokens: int
    seq_buckets: tuple[int, ...]
    batch_buckets: tuple[int, ...]
    waiting: dict[str, PoolingRequest] = field(default_factory=dict)
    _num_added: int = 0

    def grid(self) -> list[tuple[int, int]]:
        """Every (B, S) program a step can run: B * S within the budget (B = 1 always)."""
        return [(b, s) for s in self.seq_buckets for b in self.batch_buckets
                if b == 1 or b * s <= self.max_num_batched_tokens]

    def add(self, request: PoolingRequest) -> None:
        if len(request.token_ids) > self.seq_buckets[-1]:
            raise ValueError(f"input: {len(request.token_ids)} tokens, past the longest {self.seq_buckets[-1]}")
        request.arrival = self._num_added
        self._num_added += 1
        self.waiting[request.request_id] = request

    def abort(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def _fits(self, num_rows: int, longest: int) -> bool:
        if num_rows > self.max_num_seqs:
            return False
        rows, seq = bucket(num_rows, self.batch_buckets), bucket(max(longest, 1), self.seq_buckets)
        return num_rows == 1 or rows * seq <= self.max_num_batched_tokens

    def schedule(self) -> PoolingBatch | None:
        if not self.waiting:
            return None
        by_len = sorted(self.waiting.values(), key=lambda r: (len(r.token_ids), r.arrival))
        oldest = min(self.waiting.values(), key=lambda r: r.arrival)
        run: list[PoolingRequest] = []
        for req in by_len:
            if run and not self._fits(len(run) + 1, len(req.token_ids)):
                if any(r is oldest for r in run):
                    break
                run = []
            run.append(req)
        for req in run:
            del self.waiting[req.request_id]
        longest = max(len(r.token_ids) for r in run)
        return PoolingBatch(run, bucket(len(run), self.batch_buckets), bucket(max(longest, 1), self.seq_buckets))

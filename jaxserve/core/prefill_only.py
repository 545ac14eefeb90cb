"""Prefill-only requests (pooling) on a runner that runs a step as one padded [B, S] program.

A prefill-only request is computed whole in one step and is then done: no decode, no chunking, no
preemption. The pooling runner runs attention inside its step (no KV pool), so such a request takes no
KV blocks at all; what a step costs is its padded size B * S, from the runner's buckets. `pack` picks
the step: the waiting prompts sorted by length and cut into runs whose padded size fits the token
budget; the run holding the oldest request goes first, so nothing starves.

    waiting (arrival order) --sort by length--> [a a b b b c c d] --cut--> [a a b b][b c c][d]
                                                                 the oldest request's run -> step

Pure Python, no JAX; Scheduler._admit_padded calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import model_validator

from jaxserve.core.validation import config_dataclass

if TYPE_CHECKING:
    from jaxserve.core.request import Request


WINDOW_ROWS = 8  # pack sorts the oldest 8 steps' worth of waiting requests


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


@config_dataclass()
class PaddedBatching:
    """The runner's [B, S] buckets (SchedulerConfig.padded_batching): rows B, padded length S."""
    seq_buckets: tuple[int, ...]
    batch_buckets: tuple[int, ...]

    @model_validator(mode="after")
    def _check(self) -> "PaddedBatching":
        for name, buckets in (("seq_buckets", self.seq_buckets), ("batch_buckets", self.batch_buckets)):
            if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
                raise ValueError(f"{name} must be increasing positive ints, got {buckets}")
        if self.batch_buckets[0] != 1:
            raise ValueError(f"batch_buckets must start at 1 (a request alone), got {self.batch_buckets}")
        return self

    def shape(self, num_rows: int, longest: int) -> tuple[int, int]:
        """(B, S): the program that runs num_rows prompts of at most `longest` tokens."""
        return bucket(num_rows, self.batch_buckets), bucket(max(longest, 1), self.seq_buckets)

    def fits(self, num_rows: int, longest: int, budget: int) -> bool:
        """A request alone always runs (B = 1); more only within the budget, padding counted."""
        rows, seq = self.shape(num_rows, longest)
        return num_rows == 1 or rows * seq <= budget

    def grid(self, max_num_seqs: int, budget: int) -> list[tuple[int, int]]:
        """Every (B, S) program a step can run: what the runner compiles at start-up."""
        return [(b, s) for s in self.seq_buckets for b in self.batch_buckets
                if b <= bucket(max_num_seqs, self.batch_buckets) and (b == 1 or b * s <= budget)]


def pack(waiting: list[Request], max_rows: int, budget: int, padded: PaddedBatching) -> list[Request]:
    """The next step's requests, shortest first: the run of length-sorted `waiting` (oldest first)
    that holds waiting[0] and whose padded [B, S] fits `budget` with at most `max_rows` rows. Only the
    oldest WINDOW_ROWS * max_rows are sorted, so a deep queue costs a step no more than a full one."""
    if not waiting or max_rows <= 0:
        return []
    window = waiting[:WINDOW_ROWS * max_rows]
    lengths = [r.num_tokens for r in window]
    by_len = sorted(range(len(window)), key=lambda i: (lengths[i], i))  # ties: the older first
    run: list[int] = []  # indices into window; 0 is the oldest request
    has_oldest = False
    for i in by_len:
        if run and (len(run) >= max_rows or not padded.fits(len(run) + 1, lengths[i], budget)):
            if has_oldest:
                break
            run = []
        run.append(i)
        has_oldest = has_oldest or i == 0
    return [window[i] for i in _trim_to_bucket(run, padded)]


def _trim_to_bucket(run: list[int], padded: PaddedBatching) -> list[int]:
    """`run` cut to the largest batch bucket at or below its size when padding it up to the next
    bucket would waste over a quarter of the step's rows (buckets 1, 4, 16, ...: 20 rows would run as
    64; a padded row costs what a real one does). Never cut to a single row (a few requests run
    together). The cut keeps the oldest request (index 0); the rest wait for the next step.
    Measured (BENCHMARKS.md, "Embeddings"): 8 clients x 32 texts over HTTP 5.7-6.1 -> 4.8 s."""
    rows = bucket(len(run), padded.batch_buckets)
    keep = max(b for b in padded.batch_buckets if b <= len(run))
    if 4 * len(run) >= 3 * rows or keep == 1:
        return run
    start = min(run.index(0), len(run) - keep)  # pack's run always holds the oldest
    return run[start:start + keep]

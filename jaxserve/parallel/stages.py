"""Which layers each pipeline stage holds: plain arithmetic, shared by parallel/pipeline.py (which
builds the stages), worker/sizing.py (what a stage's weights and KV pool cost) and `jaxserve plan`."""

from __future__ import annotations


def stage_layer_ranges(num_layers: int, pipeline_parallel_size: int) -> list[tuple[int, int]]:
    """[start, end) layers of each pipeline stage: contiguous, sizes differing by at most one. The
    extra layers of an uneven split go to the middle stages first (from the second-to-last back, as
    vLLM), since the first stage also holds the embedding and the last the LM head. 30 / 4: 7 8 8 7."""
    pp = pipeline_parallel_size
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pipeline_parallel_size: must be in [1, num_layers={num_layers}], got {pp}")
    sizes = [num_layers // pp] * pp
    order = list(range(pp - 2, -1, -1)) + [pp - 1] if pp > 1 else [0]
    for i in order[: num_layers % pp]:
        sizes[i] += 1
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [(s, s + n) for s, n in zip(starts, sizes)]

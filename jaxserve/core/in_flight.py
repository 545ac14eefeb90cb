"""What may be scheduled while earlier steps are still on the device: the scheduler's rules for
async scheduling and for pipeline stages. Pure Python, no JAX.

    async scheduling (pipeline_depth 1)  step N+1 is scheduled while step N runs; a request of
        step N may be in step N+1 too, its sampled id fed on the device (a PLACEHOLDER input),
        unless the sampler or the scheduler needs that id on the host first.
    pipeline stages (pipeline_depth P)   up to P steps in flight, one per stage, holding disjoint
        requests: stage s runs one step while stage s+1 runs the one before (vLLM keeps P batches
        in flight). A request waits for its sampled step's update; a step takes its share of the
        runnable requests, so that the steps in flight split them instead of the first taking all.
"""

from __future__ import annotations

from jaxserve.core.request import Request
from jaxserve.core.scheduler_output import SchedulerConfig


def may_schedule(req: Request, config: SchedulerConfig) -> bool:
    """Whether a running request may be scheduled now. With a sampled step of it in flight: never
    with pipeline stages; with async scheduling, not when that step carried drafts (its next
    position is unknown), when the sampler needs its whole history (penalties) or its grammar
    state (a token bitmask), or when the in-flight tokens reach its end."""
    if req.num_output_placeholders == 0:
        return True
    if config.pipeline_depth > 1:
        return False
    params = req.sampling_params
    return not (req.drafts_in_flight or params.needs_penalties or params.needs_token_mask
                or req.num_tokens >= req.max_total_tokens(config.max_model_len))


def seqs_this_step(config: SchedulerConfig, running: list[Request], num_queued: int, num_in_flight: int) -> int:
    """The most requests the step being scheduled may take: max_num_seqs; with pipeline stages,
    ceil(runnable / free slots): `running` (those with no step in flight) and `num_queued` (waiting
    or swapped) are runnable, `num_in_flight` steps are on the device."""
    depth = config.pipeline_depth
    if depth == 1:
        return config.max_num_seqs
    runnable = sum(r.num_output_placeholders == 0 for r in running) + num_queued
    free_slots = max(1, depth - num_in_flight)
    return max(1, min(config.max_num_seqs, -(-runnable // free_slots)))

"""A grammar that passed admission's validation but failed to compile (llguidance's limits) ends its
request as aborted, reported through `Scheduler.update` like any other end; the rest of the batch
goes on and nothing leaks. The failure is injected: a real schema that validates and then fails
to compile is whatever llguidance's limits are that day."""

from __future__ import annotations

from concurrent.futures import Future

from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.core.scheduler import ModelOutput, SampledToken, Scheduler, SchedulerConfig
from jaxserve.core.structured_output import StructuredOutputManager, _RequestState


class FailingGrammars(StructuredOutputManager):
    """Every constrained request's grammar "compiled" to an exception."""

    def __init__(self) -> None:
        super().__init__(None, 0)

    def add_request(self, request_id: str, params: SamplingParams) -> None:
        if params.structured_outputs is not None:
            failed: Future = Future()
            failed.set_exception(ValueError("structured_outputs: grammar too large"))
            self.requests[request_id] = _RequestState(grammar=failed, allowed=None, bad_words=[])


def test_a_grammar_that_fails_to_compile_aborts_only_its_request() -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=64),
                      FailingGrammars())
    constrained = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    sched.add_request(Request("bad", [1, 2, 3], constrained, 0.0, eos_token_ids=(0,)))
    sched.add_request(Request("good", [4, 5], SamplingParams(max_tokens=3, ignore_eos=True), 1.0,
                              eos_token_ids=(0,)))
    updates, steps = {}, 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert "bad" not in [s.request_id for s in out.scheduled]
        sampled = {s.request_id: SampledToken(7) for s in out.scheduled if s.sample}
        for u in sched.update(out, ModelOutput(sampled)):
            updates.setdefault(u.request_id, []).append(u)
        steps += 1
        assert steps < 20
    (bad,) = updates["bad"]
    assert bad.new_tokens == [] and bad.finish_reason == "abort"
    assert [t.token_id for u in updates["good"] for t in u.new_tokens] == [7, 7, 7]
    assert updates["good"][-1].finish_reason == "length"
    assert sched.kv.num_free_blocks == 16 and not sched.structured.requests and not sched.requests

"""Prefill-only (pooling) requests in the core Scheduler, with plain lists (no JAX): the padded [B, S]
packing of core/prefill_only.py (buckets, token budget, max_num_seqs, the oldest first, abort, no
blocks, stats), and prefill-only requests on a runner with KV blocks (whole prompt, blocks freed)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxserve.core.prefill_only import PaddedBatching, length_buckets, pack, power_buckets
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import ModelOutput, SampledToken, Scheduler, SchedulerConfig, SchedulerOutput


def _pooling(rid: str, n: int, arrival: float = 0.0, types: list[int] | None = None) -> Request:
    return Request(rid, [1 + i % 7 for i in range(n)], SamplingParams(max_tokens=1), arrival, pooling=True,
                   token_type_ids=types)


def _padded(max_num_seqs: int = 8, budget: int = 256) -> Scheduler:
    padded = PaddedBatching(seq_buckets=length_buckets(16, 128), batch_buckets=power_buckets(max_num_seqs, 4))
    return Scheduler(SchedulerConfig(num_blocks=1, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=128, padded_batching=padded))


def _rows(out: SchedulerOutput) -> ModelOutput:
    """A runner's pooled rows: each request's row is its token count and sum, checkable by hand."""
    return ModelOutput(pooled={s.request_id: np.array([len(s.token_ids), sum(s.token_ids)], np.float32)
                               for s in out.scheduled})


def test_buckets() -> None:
    assert length_buckets(16, 256) == (16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert length_buckets(16, 100) == (16, 24, 32, 48, 64, 96, 100)
    assert power_buckets(64, 4) == (1, 4, 16, 64) and power_buckets(32, 4) == (1, 4, 16, 32)
    with pytest.raises(ValueError, match="^batch_buckets"):
        PaddedBatching(seq_buckets=(16, 32), batch_buckets=(4, 16))
    with pytest.raises(ValueError, match="^seq_buckets"):
        PaddedBatching(seq_buckets=(32, 16), batch_buckets=(1, 4))


def test_every_step_fits_its_program_and_every_request_runs_once() -> None:
    s = _padded()
    lengths = [3, 120, 17, 64, 5, 5, 90, 33, 1, 128, 40, 7]
    for i, n in enumerate(lengths):
        s.add_request(_pooling(str(i), n, arrival=float(i)))
    grid = set(s.config.padded_batching.grid(8, 256))
    assert s.stats().num_waiting == len(lengths)
    seen: dict[str, np.ndarray] = {}
    while s.has_unfinished_requests():
        out = s.schedule()
        rows, seq = out.padded_shape
        assert (rows, seq) in grid and len(out.scheduled) <= rows <= 8
        assert max(len(r.token_ids) for r in out.scheduled) <= seq
        assert all(r.pooling and not r.sample and not r.block_ids for r in out.scheduled)
        assert s.stats().num_running == len(out.scheduled) and s.kv.usage == 0  # no KV blocks at all
        for update in s.update(out, _rows(out)):
            assert update.finished and update.finish_reason == "stop" and update.new_tokens == []
            seen[update.request_id] = update.pooled
    assert sorted(seen, key=int) == [str(i) for i in range(len(lengths))]
    assert all(seen[str(i)][0] == n for i, n in enumerate(lengths))
    stats = s.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_prompt_tokens) == (0, 0, sum(lengths))
    assert not s.requests and stats.num_generation_tokens == 0


def test_the_oldest_request_is_in_the_first_step_and_abort() -> None:
    s = _padded(max_num_seqs=4, budget=64)
    s.add_request(_pooling("long", 100))
    for i in range(20):
        s.add_request(_pooling(f"short{i}", 4, arrival=1.0 + i))
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["long"] and out.padded_shape == (1, 128)
    s.update(out, _rows(out))
    s.abort_requests(["short0"])
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["short1", "short2", "short3", "short4"]
    s.abort_requests(["short2"])  # aborted while its step runs: its row is dropped
    assert [u.request_id for u in s.update(out, _rows(out))] == ["short1", "short3", "short4"]
    assert s.get_request("short2") is None


def test_no_starvation_under_a_stream_of_short_requests() -> None:
    """Random lengths arriving every step: each step holds the oldest waiting request."""
    rng, s, n = random.Random(0), _padded(max_num_seqs=16, budget=256), 0
    for step in range(120):  # arrivals stop at step 50; the rest drain
        for _ in range(rng.randrange(0, 6) if step < 50 else 0):
            s.add_request(_pooling(f"r{n}", rng.choice([2, 5, 9, 30, 70, 128]), arrival=float(n)))
            n += 1
        oldest = s.waiting[0].request_id if s.waiting else None
        out = s.schedule()
        if oldest is not None:
            assert oldest in {r.request_id for r in out.scheduled}
        s.update(out, _rows(out))
    assert not s.has_unfinished_requests() and s.stats().num_prompt_tokens > 0


def test_pack_respects_rows_and_budget() -> None:
    padded = PaddedBatching(seq_buckets=(16, 32, 64), batch_buckets=(1, 4, 16))
    reqs = [_pooling(str(i), n) for i, n in enumerate([60, 3, 3, 3, 3, 3, 30])]
    assert [r.request_id for r in pack(reqs, 16, 64, padded)] == ["0"]  # 64 tokens alone
    assert [r.request_id for r in pack(reqs[1:], 3, 1024, padded)] == ["1", "2", "3"]
    assert pack(reqs, 0, 64, padded) == [] and pack([], 4, 64, padded) == []


def test_padded_admission_errors() -> None:
    s = _padded()
    with pytest.raises(ValueError, match="129 tokens.*maximum context length is 128"):
        s.add_request(_pooling("x", 129))
    with pytest.raises(ValueError, match="^runner"):
        s.add_request(Request("g", [1, 2], SamplingParams(max_tokens=4), 0.0))
    with pytest.raises(ValueError, match="^token_type_ids"):
        s.add_request(_pooling("t", 4, types=[0, 1]))
    assert not s.requests and not s.waiting


def test_prefill_only_on_a_runner_with_blocks_is_whole_and_frees_them() -> None:
    """A paged runner (no padded_batching): the prompt is never chunked, takes blocks for its step and
    gives them back in update; a generation request beside it runs as usual."""
    cfg = SchedulerConfig(num_blocks=16, block_size=4, max_num_batched_tokens=32, max_model_len=32,
                          enable_chunked_prefill=True, enable_prefix_caching=True)
    s = Scheduler(cfg)
    s.add_request(Request("gen", [5] * 20, SamplingParams(max_tokens=2), 0.0))
    s.add_request(_pooling("pool", 20, arrival=1.0))
    out = s.schedule()  # gen's 20 tokens; pool's 20 do not fit the 12 left, and are not chunked
    assert [(r.request_id, len(r.token_ids)) for r in out.scheduled] == [("gen", 20)]
    s.update(out, ModelOutput(sampled={"gen": SampledToken(7)}))
    out = s.schedule()
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.scheduled] == [("gen", 1, True),
                                                                                   ("pool", 20, False)]
    assert len(out.scheduled[1].block_ids) == 5 and out.padded_shape is None
    with pytest.raises(RuntimeError, match="pooled no row"):
        s.update(out, ModelOutput(sampled={"gen": SampledToken(8)}))


def test_pooling_request_finishes_and_releases_its_blocks() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_num_batched_tokens=32, max_model_len=32))
    s.add_request(_pooling("p", 9))
    out = s.schedule()
    assert s.kv.num_free_blocks == 5
    [update] = s.update(out, _rows(out))
    assert update.finished and update.pooled[0] == 9 and s.kv.num_free_blocks == 8 and not s.requests
    assert s.get_request("p") is None and RequestStatus.FINISHED_STOPPED.finish_reason() == "stop"


def test_matryoshka_dimensions_only_when_config_declares_them(tmp_path) -> None:
    import json

    from jaxserve.pooling import io
    from jaxserve.pooling.config import read_pooling_info

    cfg = {"architectures": ["BertModel"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 32}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="dimensions"):
        io.check_dimensions(read_pooling_info(tmp_path), 4, 8)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [4, 8]}))
    info = read_pooling_info(tmp_path)
    io.check_dimensions(info, 4, 8)
    with pytest.raises(ValueError, match="dimensions"):
        io.check_dimensions(info, 3, 8)
    cut = io.embedding(np.arange(8, dtype=np.float32), 4, normalize=True)
    assert cut.shape == (4,) and abs(float(np.linalg.norm(cut)) - 1) < 1e-6


def test_a_step_in_flight_does_not_hold_back_the_next() -> None:
    """The pooling engine launches step N+1 before step N's update: N's requests are running (awaiting
    their rows) and are not scheduled again; max_num_seqs bounds each step's rows, not the two together."""
    s = _padded(max_num_seqs=4, budget=256)
    for i in range(10):
        s.add_request(_pooling(str(i), 5 + i, arrival=float(i)))
    first = s.schedule()
    second = s.schedule()
    assert [r.request_id for r in first.scheduled] == ["0", "1", "2", "3"]
    assert [r.request_id for r in second.scheduled] == ["4", "5", "6", "7"]
    assert s.stats().num_running == 8 and s.stats().num_waiting == 2
    s.abort_requests(["5"])  # aborted in flight: its row is dropped
    assert [u.request_id for u in s.update(first, _rows(first))] == ["0", "1", "2", "3"]
    third = s.schedule()
    assert [u.request_id for u in s.update(second, _rows(second))] == ["4", "6", "7"]
    assert [u.request_id for u in s.update(third, _rows(third))] == ["8", "9"]
    assert not s.has_unfinished_requests() and s.stats().num_prompt_tokens == sum(range(5, 15))


def test_pack_cuts_a_run_to_its_bucket_rather_than_pad_most_rows() -> None:
    """20 rows would run as a 64-row program (44 padded rows): 16 run now, the oldest among them,
    and 4 wait; 50 rows (78% of 64) run whole; 2 rows are never cut to 1."""
    padded = PaddedBatching(seq_buckets=(16, 32), batch_buckets=(1, 4, 16, 64))
    reqs = [_pooling(str(i), 30 - i) for i in range(20)]  # the oldest is the longest
    chosen = [r.request_id for r in pack(reqs, 64, 4096, padded)]
    assert len(chosen) == 16 and "0" in chosen
    assert len(pack([_pooling(str(i), 8) for i in range(50)], 64, 4096, padded)) == 50
    assert len(pack([_pooling(str(i), 8) for i in range(2)], 64, 4096, padded)) == 2

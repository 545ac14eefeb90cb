"""LoRA in the pure-Python parts: the scheduler's adapter limit (no starvation), the prefix cache
keyed by adapter, the runner's slot table, the manager's host LRU, LoRARequest and --lora-modules."""

from __future__ import annotations

import pytest

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.lora.manager import SlotTable
from jaxserve.lora.request import LoRAModulePath, LoRARequest
from tests.scheduler_helpers import FakeRunner, make_request, reference, salt


def _drive(cfg: SchedulerConfig, arrivals: list[tuple[int, object]]) -> tuple[dict, list]:
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    pending, done, steps = sorted(arrivals, key=lambda a: a[0]), {}, []
    for step in range(2000):
        while pending and pending[0][0] <= step:
            sched.add_request(pending.pop(0)[1])
        if not pending and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        adapters = {s.lora_int_id for s in out.scheduled if s.lora_int_id}
        assert len(adapters) <= cfg.max_loras, adapters
        steps.append(out)
        for update in sched.update(out, runner.execute(out)):
            if update.finished:
                done[update.request_id] = step
    else:
        raise AssertionError("requests did not finish")
    return done, steps


def _lora_request(rid: str, lora_id: int, prompt: list[int], max_tokens: int = 6):
    req = make_request(rid, prompt, max_tokens=max_tokens, ignore_eos=True)
    req.lora_int_id = lora_id
    return req


def test_at_most_max_loras_adapters_a_step_and_every_request_right():
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                          max_loras=2)
    reqs = [_lora_request(f"r{i}", i % 5, [1 + i, 2, 3, 4 + i], 4 + i % 3) for i in range(15)]
    done, steps = _drive(cfg, [(0, r) for r in reqs])
    assert set(done) == {r.request_id for r in reqs}
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, salt(r.request_id), r.sampling_params, 64)
    # base-model requests (id 0) ran beside adapters: they take no slot
    assert any(0 in {s.lora_int_id for s in o.scheduled} and len({s.lora_int_id for s in o.scheduled}) == 3
               for o in steps)


def test_no_starvation_behind_a_busy_adapter():
    """Adapter 1 keeps getting new requests; adapter 2's one request (max_loras 1) still runs soon."""
    cfg = SchedulerConfig(num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                          max_model_len=64, max_loras=1)
    arrivals = [(s, _lora_request(f"a{s}", 1, [5, 6, 7, s + 1], 4)) for s in range(0, 60, 2)]
    arrivals.append((1, _lora_request("b", 2, [9, 9, 9], 4)))
    arrivals.append((1, _lora_request("base", 0, [3, 3], 4)))
    done, _ = _drive(cfg, arrivals)
    assert done["b"] < 20, done["b"]  # not after the whole stream of adapter 1
    assert done["base"] < 10


def test_lora_request_refused_without_lora():
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_model_len=32, max_num_batched_tokens=32))
    with pytest.raises(ValueError, match="^lora_request"):
        sched.add_request(_lora_request("x", 3, [1, 2]))


def test_prefix_cache_keys_blocks_by_adapter():
    kv = KVCacheManager(16, 4, enable_caching=True)
    prompt = list(range(1, 14))
    kv.set_extra_key("a", 1)
    assert kv.allocate_slots("a", 0, len(prompt)) == []
    kv.cache_blocks("a", prompt, len(prompt))
    kv.set_extra_key("same", 1)
    kv.set_extra_key("other", 2)
    assert len(kv.get_computed_blocks("same", prompt)) == 3  # same adapter: shared
    assert kv.get_computed_blocks("other", prompt) == []  # another adapter: nothing
    assert kv.get_computed_blocks("base", prompt) == []  # the base model: nothing


def test_slot_table_reuses_least_recently_used_slot():
    table = SlotTable(2)
    slots, writes = table.assign({0, 7})
    assert slots == {7: 1} and writes == [(1, 7)]
    slots, writes = table.assign({7, 8})
    assert slots == {7: 1, 8: 2} and writes == [(2, 8)]
    table.assign({8})
    slots, writes = table.assign({8, 9})  # 7 is the least recently used
    assert slots == {8: 2, 9: 1} and writes == [(1, 9)]
    with pytest.raises(ValueError, match="^max_loras"):
        table.assign({1, 2, 3})


def test_lora_request_and_modules():
    r = LoRARequest("sql", 1, "/a")  # vLLM's positional form
    assert (r.lora_name, r.lora_int_id, r.lora_path, r.base_model_name) == ("sql", 1, "/a", None)
    with pytest.raises(ValueError, match="^lora_int_id"):
        LoRARequest("sql", 0, "/a")
    assert LoRAModulePath.parse("sql=/x/y") == LoRAModulePath("sql", "/x/y")
    assert LoRAModulePath.parse('{"name": "s", "path": "/p", "base_model_name": "b"}') == LoRAModulePath("s", "/p", "b")
    with pytest.raises(ValueError, match="^lora_modules"):
        LoRAModulePath.parse("nopath")
    from jaxserve import LoRARequest as top

    assert top is LoRARequest

"""The pooling scheduler with plain lists (no JAX): buckets, the token budget, no starvation."""

from __future__ import annotations

import pytest

from jaxserve.pooling.scheduler import PoolingRequest, PoolingScheduler, length_buckets, power_buckets


def _scheduler(max_num_seqs: int = 8, budget: int = 256) -> PoolingScheduler:
    return PoolingScheduler(max_num_seqs, budget, length_buckets(16, 128), power_buckets(max_num_seqs, 4))


def test_buckets() -> None:
    assert length_buckets(16, 256) == (16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert length_buckets(16, 100) == (16, 24, 32, 48, 64, 96, 100)
    assert power_buckets(64, 4) == (1, 4, 16, 64) and power_buckets(32, 4) == (1, 4, 16, 32)


def test_every_step_fits_its_program_and_every_request_runs_once() -> None:
    s = _scheduler()
    lengths = [3, 120, 17, 64, 5, 5, 90, 33, 1, 128, 40, 7]
    for i, n in enumerate(lengths):
        s.add(PoolingRequest(str(i), [1] * n))
    seen: list[str] = []
    grid = set(s.grid())
    while s.has_unfinished():
        batch = s.schedule()
        assert (batch.num_rows, batch.seq_len) in grid
        assert len(batch.requests) <= batch.num_rows <= 8
        assert max(len(r.token_ids) for r in batch.requests) <= batch.seq_len
        seen += [r.request_id for r in batch.requests]
    assert sorted(seen, key=int) == [str(i) for i in range(len(lengths))]


def test_the_oldest_request_is_in_the_first_step() -> None:
    s = _scheduler(max_num_seqs=4, budget=64)
    s.add(PoolingRequest("long", [1] * 100))
    for i in range(20):
        s.add(PoolingRequest(f"short{i}", [1] * 4))
    assert [r.request_id for r in s.schedule().requests] == ["long"]
    s.abort("short0")
    assert "short0" not in {r.request_id for r in s.schedule().requests}


def test_too_long_is_refused() -> None:
    with pytest.raises(ValueError, match="input"):
        _scheduler().add(PoolingRequest("x", [1] * 129))


def test_matryoshka_dimensions_only_when_config_declares_them(tmp_path) -> None:
    import json

    import numpy as np

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

"""The multi-host step codec (jaxserve/parallel/host_channel.py): a PreparedStep survives the trip
exactly, and anything that is not a typed step (a pickle above all) is refused with a ValueError."""

from __future__ import annotations

import dataclasses
import json
import pickle
import struct
import zlib

import numpy as np
import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.parallel.host_channel import MAGIC, StepCodec
from jaxserve.sample.sampling_metadata import RowInfo, SamplingMetadata, min_tokens_suppress_ids
from jaxserve.worker.input_batch import pack
from jaxserve.engine.multihost import CODEC, StepMessage
from jaxserve.worker.model_runner import PreparedStep, PromptLogprobChunk


def _step() -> PreparedStep:
    batch, _ = pack(SchedulerOutput(), 16, 4, 8, 16, decode_only=False)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=3, logprobs=2, logit_bias={5: 1.5})
    infos = [RowInfo(params, 3 + i, i, [1, 2, 3], [4] * i, min_tokens_suppress_ids(params, i)) for i in range(3)]
    md = SamplingMetadata.build_host(infos, 4, 64, None, 2)
    chunk = PromptLogprobChunk(np.arange(64, dtype=np.int32), np.ones(64, np.int32), [("a", 1, 7, 2)])
    return PreparedStep(swap_out=[(1, 2)], swap_in=[], copy_blocks=[(3, 4), (5, 6)], batch=batch,
                        rows=np.array([2, 0, 0, 0], np.int32), prompt_logprobs=[chunk], sampling=md,
                        sample_ids=[("a", 2, 0), ("b#1", 0, 1), ("é", 0, 0)])


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("compress", [True, False])
def test_a_prepared_step_round_trips_exactly(compress):
    codec = StepCodec(CODEC.types.values(), compress=compress)
    step = _step()
    _assert_same(codec.decode(codec.encode(step)), step)
    assert codec.decode(codec.encode(None)) is None  # the stop message
    _assert_same(codec.decode(codec.encode(PreparedStep())), PreparedStep())


def test_a_step_message_names_its_adapters_exactly():
    """What a worker rank reads a LoRA adapter from: (id, name, path) beside the step."""
    msg = StepMessage(dataclasses.replace(_step(), lora_writes=[(1, 7), (2, 3)]),
                      [(7, "sql-é", "/adapters/sql"), (3, "chat", "/shared/chat adapter")])
    _assert_same(CODEC.decode(CODEC.encode(msg)), msg)


class Planted:
    ran = False

    def __reduce__(self):
        return (setattr, (Planted, "ran", True))


def _raw(header: dict, arrays: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return b"R" + MAGIC + struct.pack("<I", len(h)) + h + arrays


@pytest.mark.parametrize("payload", [
    pickle.dumps(Planted()), zlib.compress(pickle.dumps(Planted())), b"Z" + zlib.compress(pickle.dumps(Planted())),
    b"R" + pickle.dumps(Planted()), b"", b"R" + MAGIC + b"\xff\xff\xff\xff{",
    _raw({"tree": {"d": "Planted", "f": {}}, "arrays": []}),  # a type outside the allow-list
    _raw({"tree": {"d": "PromptLogprobChunk", "f": {"rows": None}}, "arrays": []}),  # missing fields
    _raw({"tree": {"a": 0}, "arrays": [["object", [1], 0, 8]]}, b"\0" * 8),  # object dtype
    _raw({"tree": {"a": 0}, "arrays": [["int32", [4], 0, 16]]}, b"\0" * 8),  # past the buffer
    _raw({"tree": {"a": 1}, "arrays": [["int32", [2], 0, 8]]}, b"\0" * 8),  # no such array
    _raw({"tree": {"a": 0}, "arrays": [["int32", [3], 0, 8]]}, b"\0" * 8),  # shape and size disagree
    _raw({"tree": {"__reduce__": 1}, "arrays": []}),
    _raw({"tree": None}),
], ids=lambda p: str(len(p)))
def test_anything_but_a_typed_step_is_refused_and_never_run(payload):
    with pytest.raises(ValueError, match="step message"):
        CODEC.decode(payload)
    assert Planted.ran is False


def test_a_decompression_bomb_is_refused(monkeypatch):
    from jaxserve.parallel import host_channel

    monkeypatch.setattr(host_channel, "MAX_MESSAGE_BYTES", 1 << 20)
    with pytest.raises(ValueError, match="larger than"):
        CODEC.decode(b"Z" + zlib.compress(MAGIC + b"\0" * (2 << 20)))


def test_only_numeric_arrays_and_known_types_are_encoded():
    with pytest.raises(TypeError, match="object"):
        CODEC.encode(PreparedStep(rows=np.array([Planted()], dtype=object)))
    with pytest.raises(TypeError, match="Planted"):
        CODEC.encode(PreparedStep(sample_ids=[Planted()]))

"""Data parallel 2 x (tensor or pipeline) parallel 2 on 4 (forced CPU) devices, through the real HTTP server;
LoRA adapters served by every replica, against transformers + peft."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multidevice  # several (fake) devices or processes: make test-fast skips them

import torch
import transformers


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir) -> Path:
    return tiny_llama_dir  # conftest.py: a tiny random Llama with the default model's tokenizer



@pytest.fixture(scope="module")
def results(model_dir, tiny_lora_refs, tmp_path_factory) -> dict:
    """Both layouts in one subprocess (one reference engine)."""
    root = Path(__file__).resolve().parents[1]
    refs_path = tmp_path_factory.mktemp("dp") / "refs.json"
    refs_path.write_text(json.dumps(tiny_lora_refs))
    proc = subprocess.run([sys.executable, "-m", "tests.dp_worker", str(model_dir), str(refs_path)], cwd=root,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_dp2_serves_correctly_over_both_replicas(results, layout):
    """Each replica on its own pair of devices: tensor parallel 2, or two pipeline stages."""
    result = results[layout]
    assert all(result["match"]), result
    assert all(n > 0 for n in result["served"]) and sum(result["served"]) == 12, result
    assert sorted(sum(result["devices"], [])) == [0, 1, 2, 3], result  # two disjoint pairs of devices
    if layout == "tp":  # (the pp layout's replicas start eager: tests/dp_worker.py)
        assert result["compiles_after_warmup"] == 0


def test_dp2_serves_lora_adapters_on_every_replica(results, tiny_lora_refs):
    """--data-parallel-size 2 with --enable-lora over HTTP: qv8 from --lora-modules, all4 and mlp16rs
    loaded at once over /v1/load_lora_adapter, each on both replicas under one id; completions naming
    them (on both replicas, 3 adapters over 2 slots each) give peft's tokens and logprobs; unloading
    removes the name from every replica."""
    from tests.lora_helpers import compare_with_peft

    lora = results["tp"]["lora"]
    assert lora["load_status"] == [200, 200]
    ids = {n: set(v) for n, v in lora["ids"].items()}
    assert all(len(v) == 1 for v in ids.values()) and len(set().union(*ids.values())) == 3, lora["ids"]
    assert all(n > 0 for n in lora["served"]), lora["served"]
    assert len(lora["completions"]) == 9
    compare_with_peft(lora["completions"], tiny_lora_refs)
    assert lora["unload_status"] == 200 and lora["unloaded_status"] == 404
    assert lora["resolved_after_unload"] == [False, False]

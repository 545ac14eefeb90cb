"""Data parallel 2 x (tensor or pipeline) parallel 2 on 4 (forced CPU) devices, through the real HTTP server."""

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
def results(model_dir) -> dict:
    """Both layouts in one subprocess (one reference engine)."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "tests.dp_worker", str(model_dir)], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_dp2_serves_correctly_over_both_replicas(results, layout):
    """Each replica on its own pair of devices: tensor parallel 2, or two pipeline stages."""
    result = results[layout]
    assert all(result["match"]), result
    assert all(n > 0 for n in result["served"]) and sum(result["served"]) == 12, result
    assert sorted(sum(result["devices"], [])) == [0, 1, 2, 3], result  # two disjoint pairs of devices
    assert result["compiles_after_warmup"] == 0

"""Pipeline parallelism (jaxserve/parallel/pipeline.py) on 8 fake CPU devices, in a subprocess
(tests/pipeline_worker.py): greedy tokens under PP 2, 3, 4 with TP 1 and 2 equal one device's,
and each device holds only its stage's weights and KV pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multidevice  # several (fake) devices or processes: make test-fast skips them

ROOT = Path(__file__).resolve().parent.parent


def run_worker(*args: str, timeout: int = 900) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.pipeline_worker", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny() -> dict:
    return run_worker("tiny")


CASES = ["llama_gqa/tp1/pp4", "llama_gqa/tp2/pp3", "llama_gqa/tp1/pp2/async", "qwen2_bias_tied/tp2/pp2",
         "mistral_sliding/tp1/pp3/async"]


@pytest.mark.parametrize("case", CASES)
def test_pipeline_greedy_tokens_equal_one_device(tiny, case):
    r = tiny[case]
    assert r["equal"], (r["tokens"], r["reference"])
    # the warmed cases (tests/pipeline_worker.WARMED: TP x PP, async stages) hold 0 compilations after
    # warm-up; the others start eager
    assert r["compiles_after_warmup"] == 0 or not r["warmed"]


def test_a_tensor_parallel_and_an_async_case_warm_up(tiny):
    assert {c for c in CASES if tiny[c]["warmed"]} == {"llama_gqa/tp2/pp3", "mistral_sliding/tp1/pp3/async"}


@pytest.mark.parametrize("case", CASES)
def test_each_device_holds_only_its_stage(tiny, case):
    r = tiny[case]
    assert r["weights"], (r["held"]["weights"], r["expect_weights"])
    assert r["kv"], (r["held"]["kv"], r["expect_kv"])


@pytest.mark.slow
def test_default_model_pp4_uneven_equals_one_device():
    """SmolLM2-135M's 30 layers in stages of 7, 8, 8, 7."""
    r = run_worker("default", "4")["default/pp4"]
    assert r["equal"], (r["tokens"], r["reference"])

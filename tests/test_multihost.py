"""Two OS processes on 127.0.0.1 joined by jax.distributed (gloo collectives on CPU), one device
each, one tensor-parallel mesh (TP 2) over both: the same tokens as one process on one device.

Every process is a subprocess (tests/multihost_worker.py or `jaxserve serve`), since the main
pytest process has already initialised jax; every wait is bounded, so a hang fails the test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxserve.engine.args import EngineArgs
from tests import multihost_worker as worker

pytestmark = pytest.mark.multidevice  # several (fake) devices or processes: make test-fast skips them

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu",
       "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
TIMEOUT_S = 480  # a bound against hangs, far above a rank's time with the other xdist worker beside it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def run_ranks(commands: list[list[str]], tmp: Path) -> list[Path]:
    """Start one process per command at once, wait (bounded) for all; their log files."""
    logs = [tmp / f"rank{r}.log" for r in range(len(commands))]
    procs = []
    for cmd, log in zip(commands, logs):
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT))
    try:
        for r, (p, log) in enumerate(zip(procs, logs)):
            assert p.wait(TIMEOUT_S) == 0, f"rank {r} failed:\n{_tail(log)}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return logs


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir) -> Path:
    return tiny_llama_dir  # conftest.py: a tiny random Llama with the default model's tokenizer



@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> dict:
    """The same requests in one process on one device, no mesh."""
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "ref.json"
    run_ranks([[sys.executable, "-m", "tests.multihost_worker", "reference", str(model_dir), str(out)]], tmp)
    ref = json.loads(out.read_text())
    assert ref["num_devices"] == 1 and ref["num_preemptions"] > 0  # the swap path is exercised
    return ref


def run_two_ranks(model_dir: Path, tmp: Path, *extra: str) -> tuple[dict, dict]:
    port = free_port()
    outs = [tmp / f"rank{r}.json" for r in range(2)]
    run_ranks([[sys.executable, "-m", "tests.multihost_worker", "rank", str(model_dir), str(outs[r]), str(port),
                str(r), *extra] for r in range(2)], tmp)
    leader, follower = (json.loads(o.read_text()) for o in outs)
    for r in (leader, follower):
        assert r["process_count"] == 2 and r["num_devices"] == 2 and r["local_devices"] == 1
        assert r["compiles_after_warmup"] == 0  # the warm-up lined up on both ranks
    return leader, follower


def test_two_processes_tensor_parallel_match_one_process(model_dir, reference, tmp_path):
    leader, follower = run_two_ranks(model_dir, tmp_path)
    for r in (leader, follower):
        assert r["mesh_processes"] == [0, 1]  # one mesh over both processes' devices
        assert r["wq_shard"][-1] * 2 == r["wq_shape"][-1]  # each process holds half of each split weight
    assert follower["steps_run"] == leader["steps_sent"] == leader["steps"] == reference["steps"]
    assert_same_results(leader, reference)


def test_two_processes_pipeline_a_stage_each_match_one_process(model_dir, reference, tmp_path):
    """PP 2 over two processes (gloo): stage 0 (embedding, layer 0) on rank 0, stage 1 (layer 1, LM
    head, sampler) on rank 1; the residual stream and the sampled tokens cross by collectives.
    Preempted by recomputation (stages refuse swap): the same outputs as the swapping reference's,
    in another schedule."""
    leader, follower = run_two_ranks(model_dir, tmp_path, "pp")
    for r in (leader, follower):
        assert r["stage_processes"] == [[0], [1]]
    # each process holds only its own stage's weights and KV pool
    assert leader["stage_bytes"][0] > 0 and leader["stage_bytes"][1] == 0
    assert follower["stage_bytes"][1] > 0 and follower["stage_bytes"][0] == 0
    assert leader["local_bytes"] == leader["stage_bytes"][0] and follower["local_bytes"] == follower["stage_bytes"][1]
    assert follower["steps_run"] == leader["steps_sent"] == leader["steps"]
    assert leader["num_preemptions"] > 0
    assert_same_results(leader, reference, same_schedule=False)


def assert_same_results(leader: dict, reference: dict, same_schedule: bool = True) -> None:
    assert not same_schedule or leader["num_preemptions"] == reference["num_preemptions"]
    assert leader["results"].keys() == reference["results"].keys()
    for rid, ref in reference["results"].items():
        ours = leader["results"][rid]
        assert ours["tokens"] == ref["tokens"], rid  # greedy and the seeded sample alike
        assert ours["text"] == ref["text"], rid
        if ref["logprobs"]:
            assert max(abs(a - b) for a, b in zip(ours["logprobs"], ref["logprobs"])) < 1e-4, rid
        for a, b in zip(ours["prompt_logprobs"], ref["prompt_logprobs"]):
            assert (a is None) == (b is None) and (a is None or a.keys() == b.keys()), rid
            assert a is None or max(abs(a[k] - b[k]) for k in a) < 1e-4, rid


def _serve_cmd(model_dir: Path, rank: int, coordinator_port: int, http_port: int, *extra: str) -> list[str]:
    flags = list(extra)
    for name, value in worker.ENGINE.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return [sys.executable, "-m", "jaxserve.cli", "serve", str(model_dir), "--num-hosts", "2", "--host-rank", str(rank),
            "--coordinator", f"127.0.0.1:{coordinator_port}", "--tensor-parallel-size", "2",
            "--host", "127.0.0.1", "--port", str(http_port), *flags]


def test_jaxserve_serve_on_two_hosts(model_dir, reference, tiny_lora_refs, tmp_path):
    """`jaxserve serve --num-hosts 2` on both ranks with the SAME --port: rank 1 must not start an HTTP
    server (it would fail to bind). Rank 0 answers; SIGTERM stops rank 0, which stops rank 1; both exit 0.
    With LoRA: qv8 from --lora-modules, all4 and mlp16rs loaded over HTTP (on rank 0 only: each step
    that writes an adapter into a slot names it to rank 1, which reads it from the same path), 3 adapters
    over 2 slots, give peft's tokens and logprobs; rank 1 compiles nothing for them."""
    import httpx

    from tests.lora_helpers import compare_with_peft, http_lora_completions

    coord, http = free_port(), free_port()
    lora = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
            "--lora-modules", f"qv8={tiny_lora_refs['qv8']['path']}")
    env = {**ENV, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    logs = [tmp_path / f"serve{r}.log" for r in range(2)]
    procs = []
    for r in range(2):
        with open(logs[r], "wb") as f:
            procs.append(subprocess.Popen(_serve_cmd(model_dir, r, coord, http, *lora), cwd=ROOT, env=env, stdout=f,
                                          stderr=subprocess.STDOUT))
    base = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            for r, p in enumerate(procs):
                assert p.poll() is None, f"rank {r} exited early:\n{_tail(logs[r])}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"no /health after {TIMEOUT_S} s:\n{_tail(logs[0])}"
            time.sleep(0.5)
        for i, prompt in enumerate(worker.PROMPTS[:3]):
            resp = httpx.post(f"{base}/v1/completions", timeout=120, json={
                "model": str(model_dir), "prompt": prompt, "max_tokens": worker.MAX_TOKENS, "temperature": 0,
                "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == reference["results"][f"greedy-{i}"]["text"], i
        for name in ("all4", "mlp16rs"):
            resp = httpx.post(f"{base}/v1/load_lora_adapter", timeout=60,
                              json={"lora_name": name, "lora_path": tiny_lora_refs[name]["path"]})
            assert resp.status_code == 200, resp.text
        compare_with_peft(http_lora_completions(base, ["qv8", "all4", "mlp16rs"], tiny_lora_refs["prompt_ids"]),
                          tiny_lora_refs)
        procs[0].send_signal(signal.SIGTERM)
        for r, p in enumerate(procs):
            assert p.wait(60) == 0, f"rank {r}:\n{_tail(logs[r])}"
        follower_log = logs[1].read_text(errors="replace")
        assert "host rank 1: ran" in follower_log and "0 compilations after warm-up" in follower_log
        assert "Uvicorn running" not in follower_log and "Uvicorn running" in logs[0].read_text(errors="replace")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


# ---- faults and hostile input --------------------------------------------------------------------

def test_a_planted_pickle_in_the_store_is_refused_not_run(tmp_path):
    """Anyone reaching the coordinator can write to its key-value store: a pickle put where a worker's
    next step goes is refused with a ValueError and never unpickled (it would have created a file)."""
    port, out = free_port(), tmp_path / "planted.json"
    run_ranks([[sys.executable, "-m", "tests.multihost_worker", "planted", str(port), str(r), str(out)]
               for r in range(2)], tmp_path)
    result = json.loads(out.read_text())
    assert result["unpickled"] is False and not Path(str(out) + ".pwned").exists()
    assert all(e and "not a jaxserve typed step" in e for e in result["errors"]), result["errors"]
    assert result["stop"] is None  # the real (typed) message after them still arrives


KILL_BOUND_S = 45  # heartbeat timeout 4 s + exit grace 5 s, with room for a loaded 2-core machine


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_killed_or_hung_rank_is_noticed_and_rank_0_exits_within_a_bound(fault, model_dir, tmp_path):
    """Rank 1 is SIGKILLed (or SIGSTOPped: alive, silent) while rank 0 serves: rank 0's step fails (the
    engine loop ends its requests with errors), or, stuck in a collective with the hung rank, rank 0's
    watchdog misses its heartbeat and exits; non-zero and within a bound either way, never a hang."""
    port = free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = []
    for r in range(2):
        with open(logs[r], "wb") as f:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.multihost_worker", "rank", str(model_dir), str(outs[r]), str(port),
                 str(r), "killed"], cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not Path(str(outs[0]) + ".serving").exists():
            for r, p in enumerate(procs):
                assert p.poll() is None, f"rank {r} exited early:\n{_tail(logs[r])}"
            assert time.monotonic() < deadline, f"rank 0 never served:\n{_tail(logs[0])}"
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        killed_at = time.time()
        rc = procs[0].wait(KILL_BOUND_S)
        exited_at = time.time()
        assert rc != 0, _tail(logs[0])
        assert exited_at - killed_at < KILL_BOUND_S
        if outs[0].exists():  # the failed step's error (a collective's, or the watchdog's)
            failed = json.loads(outs[0].read_text())
            assert failed["error"] and failed["failed_at"] - killed_at < KILL_BOUND_S
        else:  # stuck in a collective: the watchdog's exit
            assert rc == 3 and "host rank 1 stopped responding" in _tail(logs[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


# ---- in-process: the flags ----------------------------------------------------------------------

def test_multihost_flags_are_validated():
    assert EngineArgs(num_hosts=2, host_rank=1, coordinator="10.0.0.1:1234").num_hosts == 2
    with pytest.raises(ValueError, match="host_rank"):
        EngineArgs(num_hosts=2, host_rank=2)
    with pytest.raises(ValueError, match="num_hosts"):
        EngineArgs(num_hosts=0)
    with pytest.raises(ValueError, match="coordinator must be ADDR:PORT"):
        EngineArgs(coordinator="10.0.0.1")


def test_multihost_is_enabled_by_flags_or_the_jax_environment(monkeypatch):
    from jaxserve.engine import multihost

    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    assert not multihost.is_enabled(EngineArgs())
    assert multihost.is_enabled(EngineArgs(num_hosts=2))
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    assert multihost.is_enabled(EngineArgs())

"""Multi-LoRA throughput on the CPU: workload A over 8 adapters against the same load on the base model.

    PYTHONPATH=. python scripts/bench_lora.py [--rounds 2] [--num-prompts 64] [--rank 8]

Writes 8 PEFT-format adapters of the default model (adapter_config.json + adapter_model.safetensors,
rank --rank, every projection targeted, random A and B) to a temporary directory, starts two
`jaxserve serve` processes -- the base model with no LoRA flags, and `--enable-lora --max-loras 8
--max-lora-rank R --lora-modules a0=... a7=...` -- and alternates `jaxserve bench serve` (workload A:
lognormal, 64 requests, --max-concurrency 32, greedy, --ignore-eos) between them: the base server
with its own model name, the LoRA server with `--lora-modules a0 .. a7` (each request a random
adapter). Prints one row per round and the ratio of output tok/s. --offline: the same requests
through LLM.generate in one process (two engines, a smaller bucket grid).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

JAXSERVE = str(Path(sys.executable).parent / "jaxserve")
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WORKLOAD_A = ["--dataset-name", "lognormal", "--tokenizer", "default", "--max-concurrency", "32",
              "--temperature", "0", "--ignore-eos"]


def _dims() -> tuple[int, dict[str, tuple[int, int]]]:
    from jaxserve.weights.loader import load_model

    model = load_model(None, dtype="float32", progress=False)
    from jaxserve.lora.peft import MODULES as PEFT, module_dims

    dims = module_dims(model.config)
    return model.config.num_layers, {hf: dims[ours] for hf, ours in PEFT.items()}


def make_adapters(root: Path, num: int, rank: int) -> list[str]:
    from safetensors.numpy import save_file

    num_layers, dims = _dims()
    rng = np.random.default_rng(0)
    paths = []
    for k in range(num):
        path = root / f"a{k}"
        path.mkdir(parents=True)
        tensors = {}
        for layer in range(num_layers):
            for m in MODULES:
                part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{part}.{m}"
                n_in, n_out = dims[m]
                a = rng.standard_normal((rank, n_in)) / np.sqrt(n_in)
                tensors[f"{prefix}.lora_A.weight"] = a.astype(np.float32)
                tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.02).astype(np.float32)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": MODULES, "bias": "none",
            "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}))
        paths.append(str(path))
    return paths


def start(port: int, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [JAXSERVE, "serve", "--port", str(port), *extra]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 1800) -> str:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server on {port} exited with {proc.returncode}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
            if r.status_code == 200:
                return r.json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(3)
    raise TimeoutError(f"server on {port} not ready")


def bench(port: int, num_prompts: int, models: list[str] | None, out: Path) -> float:
    cmd = [JAXSERVE, "bench", "serve", "--port", str(port), "--num-prompts",
           str(num_prompts), *WORKLOAD_A, "--disable-tqdm", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name]
    if models:
        cmd += ["--lora-modules", *models]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return float(json.loads(out.read_text())["output_throughput"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--offline", action="store_true", help="in one process, no servers (see offline())")
    ap.add_argument("--max-num-batched-tokens", type=int, default=128, help="--offline's token budget")
    args = ap.parse_args()
    if args.offline:
        return offline(args)
    tmp = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    paths = make_adapters(tmp / "adapters", args.num_adapters, args.rank)
    names = [f"a{k}" for k in range(args.num_adapters)]
    base = start(8101, [], tmp / "base.log")
    lora = start(8102, ["--enable-lora", "--max-loras", str(args.num_adapters), "--max-lora-rank", str(args.rank),
                        "--lora-modules", *[f"{n}={p}" for n, p in zip(names, paths)]], tmp / "lora.log")
    try:
        wait_ready(8101, base)
        wait_ready(8102, lora)
        print("| round | base model output tok/s | 8 adapters output tok/s | ratio |\n|---|---:|---:|---:|")
        for r in range(args.rounds):
            b = bench(8101, args.num_prompts, None, tmp / f"base{r}.json")
            a = bench(8102, args.num_prompts, names, tmp / f"lora{r}.json")
            print(f"| {r + 1} | {b:.2f} | {a:.2f} | {a / b:.2f}x |", flush=True)
    finally:
        for p in (base, lora):
            p.terminate()
            p.wait(timeout=60)
    print(f"logs and results in {tmp}")




def offline(args: argparse.Namespace) -> None:
    """In one process (no HTTP, a smaller bucket grid, so two warm-ups fit a shared 2-core machine):
    workload A's requests (log-normal, medians 128 / 128, greedy, ignore_eos) through LLM.generate
    on a base engine and on a LoRA engine with each request under a random one of the adapters,
    alternating; output tok/s of each."""
    from jaxserve import LLM, LoRARequest, SamplingParams
    from jaxserve.bench.datasets import lognormal_requests
    from jaxserve.weights.loader import load_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    paths = make_adapters(tmp / "adapters", args.num_adapters, args.rank)
    model = load_model(None, dtype="auto", progress=False)
    flags = dict(max_num_seqs=32, max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=1024)
    base = LLM(model, progress=False, **flags)
    lora = LLM(model, progress=False, **flags, enable_lora=True, max_loras=args.num_adapters,
               max_lora_rank=args.rank)
    reqs = lognormal_requests(base.get_tokenizer(), args.num_prompts, 128, 128, seed=0)
    prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r.expected_output_len, ignore_eos=True) for r in reqs]
    rng = np.random.default_rng(1)
    adapters = [LoRARequest(f"a{k}", k + 1, p) for k, p in enumerate(paths)]
    picks = [adapters[i] for i in rng.integers(0, len(adapters), len(reqs))]
    print("| round | base model output tok/s | 8 adapters output tok/s | ratio |\n|---|---:|---:|---:|")
    for r in range(args.rounds):
        rates = []
        for llm, loras in ((base, None), (lora, picks)):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
        print(f"| {r + 1} | {rates[0]:.2f} | {rates[1]:.2f} | {rates[1] / rates[0]:.2f}x |", flush=True)
    print("compilations after warm-up:", base.llm_engine.get_stats().num_compilations_after_warmup,
          lora.llm_engine.get_stats().num_compilations_after_warmup)


if __name__ == "__main__":
    main()

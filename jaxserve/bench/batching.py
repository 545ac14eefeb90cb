"""`jaxserve bench batching`: the two claims behind paged continuous batching, measured on one engine.

1. Continuous vs static batching, same engine, same requests (log-normal prompt and
   output lengths, greedy, ignore_eos):
       continuous  all requests submitted; the scheduler refills a slot as soon as one frees
       static      batches of B formed once; each runs until its longest member finishes,
                   then the next starts (finished members stop computing, but nobody joins)
       static-padded  the classic static batch (what a padded [B, T] tensor does, like HF
                   generate): every member decodes to the batch's longest output length;
                   only each request's own tokens count as output
   -> output tokens/s of each, and the ratios.

2. KV waste, sampled after every step from the scheduler's KV manager:

       paged     = sum(len(block_table)*block_size - num_computed) / sum(len(block_table)*block_size)
       reserved  = 1 - sum(num_computed) / (num_running * max_model_len)    (contiguous, per request)
       reserved* = same, reserving prompt + max_tokens (a server that knows max_tokens)

   summed over running requests and over steps (a time average weighted by occupancy).

3. Optionally (--hf), HF transformers `generate` on the same requests: float32, static
   batches of --hf-batch-size, left-padded, each batch to its longest output.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from jaxserve.bench import datasets as ds
from jaxserve.bench.throughput import add_engine_args, make_llm

ENGINE_DEFAULTS = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512)


@dataclass
class KVWaste:
    allocated: int = 0  # token slots in running requests' block tables, summed over steps
    used: int = 0  # their computed tokens
    reserved_max_len: int = 0  # num_running * max_model_len
    reserved_max_tokens: int = 0  # sum of min(prompt + max_tokens, max_model_len)
    steps: int = 0
    running: int = 0  # summed over steps: mean batch = running / steps

    def sample(self, engine) -> None:
        sched = engine.scheduler
        kv, max_len = sched.kv, engine.max_model_len
        for req in sched.running:
            self.allocated += len(kv.get_block_ids(req.request_id)) * kv.block_size
            self.used += req.num_computed_tokens
            self.reserved_max_len += max_len
            self.reserved_max_tokens += req.max_total_tokens(max_len)
        self.running += len(sched.running)
        self.steps += 1

    def report(self) -> dict[str, float]:
        def waste(total: int) -> float:
            return 1.0 - self.used / total if total else 0.0

        return {"kv_waste_paged": waste(self.allocated), "kv_waste_reserved_max_model_len": waste(self.reserved_max_len),
                "kv_waste_reserved_max_tokens": waste(self.reserved_max_tokens),
                "mean_running": self.running / self.steps if self.steps else 0.0, "num_steps": self.steps}


def _run_to_completion(engine, kv: KVWaste, bar) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                bar.update(1)
        kv.sample(engine)


def run_mode(engine, requests: list[ds.SampleRequest], mode: str, batch_size: int,
             progress: bool = True) -> dict[str, object]:
    """`continuous` (all at once), `static` (batches of `batch_size`, each run to its end) or
    `static-padded` (the same, every member decoding to the batch's longest length) on `engine`."""
    from jaxserve.core.sampling_params import SamplingParams

    if engine.has_unfinished_requests():
        raise RuntimeError("the engine must be idle")
    kv = KVWaste()
    groups = [requests] if mode == "continuous" else [requests[i:i + batch_size]
                                                       for i in range(0, len(requests), batch_size)]
    num_out = 0
    start = time.perf_counter()
    with tqdm(total=len(requests), desc=f"{mode} batching", unit="req", disable=not progress) as bar:
        for g, group in enumerate(groups):
            longest = max(r.expected_output_len for r in group)
            for i, r in enumerate(group):
                max_tokens = longest if mode == "static-padded" else r.expected_output_len
                engine.add_request(f"{mode}-{g}-{i}", {"prompt_token_ids": r.prompt},
                                   SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
                num_out += r.expected_output_len  # useful tokens only: padding decodes are waste
            _run_to_completion(engine, kv, bar)
    elapsed = time.perf_counter() - start
    return {"mode": mode, "num_requests": len(requests), "batch_size": batch_size if mode != "continuous" else None,
            "elapsed_time": elapsed, "total_output_tokens": num_out, "output_tokens_per_second": num_out / elapsed,
            **kv.report()}


def run_hf(requests: list[ds.SampleRequest], batch_size: int, model_path: str | None = None,
           progress: bool = True) -> dict[str, object]:
    """HF transformers generate, float32, static left-padded batches; eos disabled so lengths are exact."""
    import torch
    import transformers

    from jaxserve.weights.source import default_model_path

    if model_path is None:
        gguf = default_model_path()
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                  dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    pad = 0
    num_out = 0
    start = time.perf_counter()
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    with torch.inference_mode():
        for batch in tqdm(batches, desc="HF generate", unit="batch", disable=not progress):
            width = max(r.prompt_len for r in batch)
            ids = torch.tensor([[pad] * (width - r.prompt_len) + list(r.prompt) for r in batch])
            mask = torch.tensor([[0] * (width - r.prompt_len) + [1] * r.prompt_len for r in batch])
            longest = max(r.expected_output_len for r in batch)
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad)
            num_out += sum(r.expected_output_len for r in batch)  # useful tokens: each request's own length
    elapsed = time.perf_counter() - start
    return {"mode": "hf-generate", "num_requests": len(requests), "batch_size": batch_size,
            "elapsed_time": elapsed, "total_output_tokens": num_out, "output_tokens_per_second": num_out / elapsed,
            "torch_threads": torch.get_num_threads()}


def run_batching(engine, requests: list[ds.SampleRequest], batch_size: int, *, hf: bool = False,
                 hf_batch_size: int = 32, progress: bool = True) -> dict[str, object]:
    continuous = run_mode(engine, requests, "continuous", batch_size, progress)
    static = run_mode(engine, requests, "static", batch_size, progress)
    padded = run_mode(engine, requests, "static-padded", batch_size, progress)
    res: dict[str, object] = {
        "workload": {"num_requests": len(requests), "input_lens": [r.prompt_len for r in requests],
                     "output_lens": [r.expected_output_len for r in requests]},
        "engine": {"max_num_seqs": engine.args.max_num_seqs, "max_model_len": engine.max_model_len,
                   "block_size": engine.block_size, "num_gpu_blocks": engine.num_gpu_blocks},
        "continuous": continuous, "static": static, "static_padded": padded,
        "speedup_continuous_over_static": continuous["output_tokens_per_second"] / static["output_tokens_per_second"],
        "speedup_continuous_over_static_padded": (continuous["output_tokens_per_second"]
                                                  / padded["output_tokens_per_second"]),
    }
    if hf:
        res["hf"] = run_hf(requests, hf_batch_size, progress=progress)
        res["speedup_continuous_over_hf"] = (continuous["output_tokens_per_second"]
                                             / res["hf"]["output_tokens_per_second"])  # type: ignore[index]
    stats = engine.get_stats()
    res["num_compilations_after_warmup"] = stats.num_compilations_after_warmup
    return res


def format_result(res: dict) -> str:
    w = res["workload"]
    ins, outs = w["input_lens"], w["output_lens"]
    lines = [f"workload: {w['num_requests']} requests, prompt tokens mean {sum(ins) / len(ins):.0f} "
             f"(min {min(ins)}, max {max(ins)}), output tokens mean {sum(outs) / len(outs):.0f} "
             f"(min {min(outs)}, max {max(outs)}); engine {res['engine']}",
             f"{'mode':<14}{'batch':>6}{'time s':>9}{'out tok':>9}{'out tok/s':>11}{'mean run':>10}"
             f"{'KV waste paged':>16}{'reserved max_len':>18}{'reserved max_tok':>18}"]
    for key in ("continuous", "static", "static_padded", "hf"):
        if key not in res:
            continue
        m = res[key]
        kv = (f"{m['mean_running']:>10.1f}{m['kv_waste_paged']:>16.1%}{m['kv_waste_reserved_max_model_len']:>18.1%}"
              f"{m['kv_waste_reserved_max_tokens']:>18.1%}") if "kv_waste_paged" in m else ""
        lines.append(f"{m['mode']:<14}{m['batch_size'] or '-':>6}{m['elapsed_time']:>9.1f}"
                     f"{m['total_output_tokens']:>9}{m['output_tokens_per_second']:>11.1f}{kv}")
    lines.append(f"continuous / static output tokens/s: {res['speedup_continuous_over_static']:.2f}x")
    if "static_padded" in res:
        lines.append(f"continuous / static-padded output tokens/s: {res['speedup_continuous_over_static_padded']:.2f}x")
    if "hf" in res:
        lines.append(f"continuous / HF generate output tokens/s: {res['speedup_continuous_over_hf']:.2f}x")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-median", type=int, default=64)
    p.add_argument("--output-median", type=int, default=64)
    p.add_argument("--sigma", type=float, default=0.7, help="sigma of log(length)")
    p.add_argument("--max-len", type=int, default=256, help="clip prompt and output lengths to this")
    p.add_argument("--batch-size", type=int, default=None, help="static batch size (default: --max-num-seqs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf", action="store_true", help="also run HF transformers generate (torch, float32)")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--output-json", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(p)


def main(args: argparse.Namespace) -> int:
    llm = make_llm(args, **ENGINE_DEFAULTS)
    engine = llm.llm_engine
    if 2 * args.max_len > engine.max_model_len:
        raise SystemExit(f"bench batching: --max-len {args.max_len} needs --max-model-len >= {2 * args.max_len}")
    requests = ds.mixed_requests(ds.HFTokenizer(llm.get_tokenizer()), args.num_prompts, args.input_median,
                                 args.output_median, args.sigma, args.max_len, args.seed)
    res = run_batching(engine, requests, args.batch_size or engine.args.max_num_seqs, hf=args.hf,
                       hf_batch_size=args.hf_batch_size, progress=not args.disable_tqdm)
    print(format_result(res))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(res, indent=1))
    return 0

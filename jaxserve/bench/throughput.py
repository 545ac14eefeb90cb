"""`jaxserve bench throughput`: offline, the engine in this process, every request submitted at t=0.

Prints requests/s, output and total tokens/s (vLLM's `bench throughput` JSON keys),
plus TTFT percentiles from the engine's own request metrics, so `sweep` can plot
the same trade-off offline as over HTTP. Also home of the engine-flag helpers the
other in-process subcommands share.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jaxserve.bench import datasets as ds
from jaxserve.bench.metrics import percentile, summarize
from jaxserve.entrypoints.cli_args import ENGINE_FIELDS, _add_fields

# Engine flags the in-process subcommands take (all EngineArgs fields but the seed: --seed seeds the workload).
_SKIP = ("seed", "served_model_name", "chat_template", "tensor_parallel_size", "data_parallel_size",
         "pipeline_parallel_size")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    _add_fields(parser.add_argument_group("engine"), ENGINE_FIELDS, skip=_SKIP)


def engine_kwargs(args: argparse.Namespace, **defaults: object) -> dict[str, object]:
    """The engine flags the user gave, over `defaults` (flags default to SUPPRESS, so absent means not given)."""
    given = {k: v for k, v in vars(args).items() if k in ENGINE_FIELDS and k not in _SKIP}
    return {**defaults, **given}


def make_llm(args: argparse.Namespace, model=None, **defaults: object):
    """An `LLM` from the engine flags; `model` (a LoadedModel) reuses weights already loaded."""
    from jaxserve.entrypoints.llm import LLM

    kwargs = engine_kwargs(args, **defaults)
    name = kwargs.pop("model", None)
    return LLM(model if model is not None else name, progress=not getattr(args, "disable_tqdm", False), **kwargs)


def run_throughput(llm, requests: list[ds.SampleRequest], *, progress: bool = True,
                   temperature: float = 0.0) -> dict[str, object]:
    from jaxserve.core.sampling_params import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=r.expected_output_len, ignore_eos=True)
              for r in requests]
    prompts = [{"prompt_token_ids": r.prompt} if isinstance(r.prompt, list) else r.prompt for r in requests]
    if any(r.multi_modal_data for r in requests):  # random-mm: chat prompts with their images
        from jaxserve.bench.random_mm import engine_prompts

        prompts = engine_prompts(llm, requests)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    num_in = sum(len(o.prompt_token_ids) for o in outs)
    num_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs
             if o.metrics is not None and o.metrics.first_token_time is not None]
    res: dict[str, object] = {
        "elapsed_time": elapsed,
        "num_requests": len(outs),
        "total_num_tokens": num_in + num_out,
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "requests_per_second": len(outs) / elapsed,
        "tokens_per_second": (num_in + num_out) / elapsed,
        "output_tokens_per_second": num_out / elapsed,
    }
    res.update(summarize("ttft", ttfts, (50.0, 90.0, 99.0)))
    res["p99_ttft_ms"] = percentile([t * 1000 for t in ttfts], 99.0)
    return res


def format_result(res: dict[str, object]) -> str:
    return (f"Throughput: {res['requests_per_second']:.2f} requests/s, {res['tokens_per_second']:.2f} total tokens/s, "
            f"{res['output_tokens_per_second']:.2f} output tokens/s ({res['num_requests']} requests, "
            f"{res['total_input_tokens']} in / {res['total_output_tokens']} out tokens, "
            f"{res['elapsed_time']:.1f} s; TTFT p99 {res['p99_ttft_ms']:.0f} ms)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    ds.add_dataset_args(p)
    p.set_defaults(num_prompts=64)
    p.add_argument("--output-json", default=None, help="write the result here")
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(p)


def main(args: argparse.Namespace) -> int:
    if args.dataset_name == "random-mm":
        from jaxserve.bench.random_mm import check_args

        try:
            check_args(args)  # before the model loads
        except ValueError as exc:
            raise SystemExit(f"bench throughput: {exc}") from None
    llm = make_llm(args)
    tok = ds.HFTokenizer(llm.get_tokenizer())
    try:
        requests = ds.build_requests(args, tok, as_ids=True)
        res = run_throughput(llm, requests, progress=not args.disable_tqdm)
    except ValueError as exc:
        raise SystemExit(f"bench throughput: {exc}") from None
    print(format_result(res))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(res, indent=1))
    return 0

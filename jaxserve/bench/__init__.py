"""`jaxserve bench`: measure, compare and tune a deployment.

    serve       HTTP load generator against any OpenAI-compatible server (no JAX)
    throughput  offline, engine in-process: requests/s and tokens/s on a dataset
    latency     one fixed batch, repeated: latency percentiles
    batching    continuous vs static batching and paged vs reserved KV waste, one engine
    sweep       serve or throughput over a grid of one engine parameter: table, plots, advice

A `jaxserve` subcommand (jaxserve/cli.py calls `add_parser` when `bench` is chosen): it fills in the `bench`
parser, each subcommand sets `func`. Submodules load only when chosen, so
`bench serve` starts without importing JAX.
"""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS = {
    "serve": ("jaxserve.bench.serve", "load-test an OpenAI-compatible server over HTTP"),
    "throughput": ("jaxserve.bench.throughput", "offline throughput of the engine in this process"),
    "latency": ("jaxserve.bench.latency", "latency of one fixed batch, repeated"),
    "batching": ("jaxserve.bench.batching", "continuous vs static batching; paged vs reserved KV waste"),
    "sweep": ("jaxserve.bench.sweep", "serve/throughput over a grid of one engine parameter, with plots"),
}


def _lazy_main(module: str):
    def run(args: argparse.Namespace) -> int | None:
        return importlib.import_module(module).main(args)

    return run


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="benchmark a deployment or the engine")
    sub = parser.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    # Flag definitions import no JAX (engine imports happen inside the subcommands' functions).
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(func=_lazy_main(module))
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> int:
    func = getattr(args, "func", None)
    if func is None or func is main:
        print("usage: jaxserve bench {" + ",".join(SUBCOMMANDS) + "} ...  (jaxserve bench SUBCOMMAND --help)")
        return 1
    result = func(args)
    return 0 if result is None else int(result)

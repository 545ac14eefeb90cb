"""The `jaxserve` console script: argparse subcommands serve, bench, convert and plan.

Only the chosen subcommand's module is imported and its flags built (the others
get a bare parser for the help listing), so `jaxserve --help` and `jaxserve bench
serve` start without importing JAX. Each subcommand sets `func(args) -> int | None`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

Subparsers = argparse._SubParsersAction


def _serve(sub: Subparsers, help_text: str) -> None:
    from jaxserve.entrypoints.cli_args import add_serve_args

    parser = sub.add_parser("serve", help=help_text, description=help_text)
    add_serve_args(parser, positional_model=True)

    def run(args: argparse.Namespace) -> int:
        from jaxserve.entrypoints.openai.api_server import run_from_namespace

        return run_from_namespace(args, parser)

    parser.set_defaults(func=run)


def _bench(sub: Subparsers, help_text: str) -> None:
    from jaxserve import bench

    bench.add_parser(sub)


def _convert(sub: Subparsers, help_text: str) -> None:
    from jaxserve.weights import convert

    convert.add_parser(sub)


def _plan(sub: Subparsers, help_text: str) -> None:
    try:
        plan = importlib.import_module("jaxserve.plan")
    except ModuleNotFoundError as exc:
        if exc.name != "jaxserve.plan":
            raise
        raise SystemExit("jaxserve plan: not available in this version (jaxserve/plan.py is missing)") from None
    parser = sub.add_parser("plan", help=help_text, description=help_text)
    plan.add_arguments(parser)
    parser.set_defaults(func=plan.main)


# name -> (help, builder that adds the subcommand's parser with its flags and `func`)
COMMANDS: dict[str, tuple[str, Callable[[Subparsers, str], None]]] = {
    "serve": ("start the OpenAI-compatible server", _serve),
    "bench": ("benchmark a deployment or the engine", _bench),
    "convert": ("write an Orbax checkpoint of MODEL to OUT (loads faster)", _convert),
    "plan": ("plan a deployment: which parallelism and flags fit the model and the devices", _plan),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The top parser; only `command`'s subparser gets its flags (and imports its module)."""
    top = argparse.ArgumentParser(prog="jaxserve", description="LLM inference server on JAX/XLA.")
    top.add_argument("--version", action="store_true", help="print the version and exit")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, build) in COMMANDS.items():
        if name == command:
            build(sub, help_text)
        else:
            sub.add_parser(name, help=help_text)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = top.parse_args(argv)
    if args.version:
        import jaxserve

        print(jaxserve.__version__)
        return 0
    func = getattr(args, "func", None)
    if func is None:
        top.print_help()
        return 1
    result = func(args)
    return 0 if result is None else int(result)


if __name__ == "__main__":
    sys.exit(main())

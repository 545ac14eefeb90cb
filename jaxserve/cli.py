"""The `jaxserve` console script: a registry of subcommands.

`serve` is built in. Others are plug-ins found by module name, so adding one
means writing the module and one line in `PLUGINS`; nothing is imported until
its subcommand is chosen (the CLI starts fast and a missing optional part only
hides its subcommand). A plug-in module provides

    main(args: argparse.Namespace) -> int | None
    add_arguments(parser: argparse.ArgumentParser) -> None     # optional, or
    add_parser(subparsers) -> None   # optional: argparse style; `set_defaults(func=...)` is honoured

Without `add_arguments`, the plug-in gets its `default_args` below.
Code can also add a subcommand directly with `register(Subcommand(...))`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int | None]


@dataclass(frozen=True)
class Plugin:
    module: str
    help: str
    default_args: Callable[[argparse.ArgumentParser], None]


def _convert_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="source model (name or path)")
    parser.add_argument("out", metavar="OUT", help="output directory")


def _passthrough_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the subcommand")


PLUGINS: dict[str, Plugin] = {
    "convert": Plugin("jaxserve.weights.convert", "convert model weights (MODEL OUT)", _convert_args),
    "bench": Plugin("jaxserve.bench", "benchmark a deployment or the engine", _passthrough_args),
    "plan": Plugin("jaxserve.plan", "will a model fit these GPUs: memory, KV blocks, flags (no GPU needed)",
                   _passthrough_args),
}

_REGISTRY: dict[str, Subcommand] = {}


def register(command: Subcommand) -> None:
    _REGISTRY[command.name] = command


def _serve_args(parser: argparse.ArgumentParser) -> None:
    from jaxserve.entrypoints.cli_args import add_serve_args

    add_serve_args(parser, positional_model=True)


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from jaxserve.entrypoints.openai.api_server import run_from_namespace

    return run_from_namespace(args, parser)


register(Subcommand("serve", "start the OpenAI-compatible server", _serve_args, _serve))


def _module_exists(name: str) -> bool:
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


class _OneSubparser:
    """Lets a plug-in written as `add_parser(subparsers)` fill in the parser built for it."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._parser = parser

    def add_parser(self, name: str, **kwargs: object) -> argparse.ArgumentParser:
        if isinstance(kwargs.get("help"), str):
            self._parser.description = str(kwargs["help"])
        return self._parser


def _plugin_command(name: str, plugin: Plugin) -> Subcommand:
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        module = importlib.import_module(plugin.module)
        if hasattr(module, "add_arguments"):
            module.add_arguments(parser)
        elif hasattr(module, "add_parser"):
            module.add_parser(_OneSubparser(parser))
        else:
            plugin.default_args(parser)

    def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int | None:
        func = getattr(args, "func", None) or importlib.import_module(plugin.module).main
        return func(args)

    return Subcommand(name, plugin.help, add_arguments, run)


def available() -> dict[str, Subcommand]:
    """Built-in subcommands plus the plug-ins whose module is installed."""
    commands = dict(_REGISTRY)
    for name, plugin in PLUGINS.items():
        if name not in commands and _module_exists(plugin.module):
            commands[name] = _plugin_command(name, plugin)
    return commands


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = available()
    top = argparse.ArgumentParser(prog="jaxserve", description="LLM inference server on JAX/XLA.")
    top.add_argument("--version", action="store_true", help="print the version and exit")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    for command in commands.values():
        sub.add_parser(command.name, help=command.help)
    if not argv or argv[0] not in commands:
        if argv and argv[0] in PLUGINS:
            top.error(f"'{argv[0]}' is not available in this installation ({PLUGINS[argv[0]].module} is missing)")
        ns = top.parse_args(argv)  # prints help / errors for unknown commands
        if ns.version:
            import jaxserve

            print(jaxserve.__version__)
            return 0
        top.print_help()
        return 1
    # Only the chosen subcommand's arguments are built: plug-ins are imported on demand.
    command = commands[argv[0]]
    parser = argparse.ArgumentParser(prog=f"jaxserve {command.name}", description=command.help)
    command.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    args.command = command.name
    result = command.run(args, parser)
    return 0 if result is None else int(result)


if __name__ == "__main__":
    sys.exit(main())

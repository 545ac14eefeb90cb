"""Serve flags, --config YAML precedence, the presets in configs/, and the `jaxserve` subcommands."""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import pytest

from jaxserve import cli
from jaxserve.engine.args import EngineArgs
from jaxserve.entrypoints.cli_args import ConfigError, ServeConfig, add_serve_args, resolve

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def parse(argv: list[str], *, positional: bool = True) -> ServeConfig:
    parser = add_serve_args(argparse.ArgumentParser(), positional_model=positional)
    return resolve(parser.parse_args(argv))


def test_defaults_match_engine_args() -> None:
    config = parse([])
    assert config.engine == EngineArgs()
    assert (config.server.host, config.server.port, config.server.api_key) == ("0.0.0.0", 8000, None)


def test_help_renders_every_flag() -> None:
    """`jaxserve serve --help` formats each flag's help (a bare % in one breaks all of argparse's)."""
    text = add_serve_args(argparse.ArgumentParser(), positional_model=True).format_help()
    assert "--dtype" in text and "bfloat16 dots" in text and "--kv-cache-dtype" in text


def test_vllm_serve_flags() -> None:
    config = parse(["my-model", "--host", "127.0.0.1", "--port", "9000", "--served-model-name", "m",
                    "--dtype", "bfloat16", "--max-model-len", "1024", "--gpu-memory-utilization", "0.5",
                    "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--enable-chunked-prefill",
                    "--block-size", "32", "--swap-space", "2", "--preemption-mode", "swap",
                    "--enable-prefix-caching", "--tensor-parallel-size", "2", "--seed", "7", "--api-key", "k",
                    "--chat-template", "t.jinja", "--num-gpu-blocks-override", "100", "--kv-cache-memory", "1000",
                    "--attention-backend", "pallas", "--data-parallel-size", "2", "--pipeline-parallel-size", "1"])
    e = config.engine
    assert (e.model, e.served_model_name, e.dtype, e.max_model_len, e.gpu_memory_utilization) == (
        "my-model", "m", "bfloat16", 1024, 0.5)
    assert (e.max_num_seqs, e.max_num_batched_tokens, e.enable_chunked_prefill, e.block_size) == (8, 256, True, 32)
    assert (e.swap_space, e.preemption_mode, e.enable_prefix_caching, e.tensor_parallel_size, e.seed) == (
        2.0, "swap", True, 2, 7)
    assert (e.chat_template, e.num_gpu_blocks_override, e.kv_cache_memory, e.attention_backend) == (
        "t.jinja", 100, 1000, "pallas")
    assert e.data_parallel_size == 2
    assert (config.server.host, config.server.port, config.server.api_key) == ("127.0.0.1", 9000, "k")


def test_every_engine_field_has_a_flag() -> None:
    parser = add_serve_args(argparse.ArgumentParser(), positional_model=False)
    flags = {a.dest for a in parser._actions}
    assert set(EngineArgs.field_names()) <= flags


def test_model_flag_and_positional() -> None:
    assert parse(["--model", "x"], positional=False).engine.model == "x"
    assert parse(["x", "--model", "x"]).engine.model == "x"
    with pytest.raises(ConfigError, match="model given twice"):
        parse(["x", "--model", "y"])


def test_yaml_gives_defaults_and_flags_override(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("max-num-seqs: 4\nenable_prefix_caching: true\nport: 1234\nswap-space: 3\n")
    config = parse(["--config", str(path), "--max-num-seqs", "16", "--no-enable-prefix-caching"])
    assert config.engine.max_num_seqs == 16  # the flag wins
    assert config.engine.enable_prefix_caching is False  # an explicit --no- wins over the file
    assert config.engine.swap_space == 3.0 and config.server.port == 1234  # the file wins over defaults


@pytest.mark.parametrize("text,message", [
    ("max-num-sequences: 4\n", "unknown key 'max-num-sequences'"),
    ("max-num-seqs: four\n", "max_num_seqs must be int"),
    ("enable-prefix-caching: 1\n", "enable_prefix_caching must be bool"),
    ("dtype: float8\n", "dtype must be one of"),
    ("- a\n- b\n", "mapping"),
    ("block-size: 24\n", "block_size must be one of"),
])
def test_bad_yaml_names_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        parse(["--config", str(path)])


def test_missing_config_file() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        parse(["--config", "/nonexistent/x.yaml"])


@pytest.mark.parametrize("name", ["chatbot.yaml", "batch.yaml", "long-context.yaml"])
def test_presets_load(name: str) -> None:
    config = parse(["--config", str(CONFIGS / name)])
    assert config.engine != EngineArgs()


def test_bad_flag_value_exits() -> None:
    parser = add_serve_args(argparse.ArgumentParser(), positional_model=True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-seqs", "many"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--preemption-mode", "never"])


def test_serve_and_api_server_share_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxserve.entrypoints.openai import api_server

    seen: list[ServeConfig] = []
    monkeypatch.setattr(api_server, "run_server", lambda config: seen.append(config) or 0)
    assert cli.main(["serve", "m", "--port", "1", "--max-num-seqs", "3"]) == 0
    assert api_server.main(["--model", "m", "--port", "1", "--max-num-seqs", "3"]) == 0
    assert seen[0] == seen[1] and seen[0].engine.model == "m"
    with pytest.raises(SystemExit):  # EngineArgs' validation becomes a usage error
        cli.main(["serve", "--max-num-seqs", "0"])


def _fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: object) -> None:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)


def test_convert_dispatches_to_its_module(monkeypatch: pytest.MonkeyPatch) -> None:
    def add_parser(sub: argparse._SubParsersAction) -> None:
        p = sub.add_parser("convert", help="convert")
        p.add_argument("model")
        p.add_argument("out")
        p.add_argument("--dtype", default="float32")
        p.set_defaults(func=lambda args: 7 if args.dtype == "bfloat16" else 0)

    _fake_module(monkeypatch, "jaxserve.weights.convert", add_parser=add_parser)
    assert cli.main(["convert", "a", "b", "--dtype", "bfloat16"]) == 7
    assert cli.main(["convert", "a", "b"]) == 0


def test_plan_imports_its_module_when_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []
    _fake_module(monkeypatch, "jaxserve.plan", add_arguments=lambda p: p.add_argument("--devices", type=int),
                 main=lambda args: seen.append(args) or 3)
    assert cli.main(["plan", "--devices", "8"]) == 3 and seen[0].devices == 8


def test_plan_without_its_module_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jaxserve.plan", None)  # the import then fails as if the file were absent
    with pytest.raises(SystemExit, match="plan.py is missing"):
        cli.main(["plan"])


def test_unknown_command_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["frobnicate"])
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == __import__("jaxserve").__version__
    assert cli.main([]) == 1
    listing = capsys.readouterr().out
    assert all(name in listing for name in ("serve", "bench", "convert", "plan"))


# (`plan` sizes with the model code's own parameter shapes, so it imports JAX as `serve` does.)
@pytest.mark.parametrize("argv", [["--help"], ["bench", "serve", "--help"]])
def test_cli_imports_no_jax_until_a_command_needs_it(argv: list[str]) -> None:
    code = ("import sys; from jaxserve import cli\n"
            "try: cli.main(sys.argv[1:])\nexcept SystemExit: pass\n"
            "sys.exit(1 if 'jax' in sys.modules else 0)")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_server_args_validation() -> None:
    with pytest.raises(ConfigError):
        parse(["--port", "70000"])
    with pytest.raises(ConfigError, match="max_request_body_bytes"):
        parse(["--max-request-body-bytes", "0"])
    assert parse(["--max-request-body-bytes", "1024"]).server.max_request_body_bytes == 1024

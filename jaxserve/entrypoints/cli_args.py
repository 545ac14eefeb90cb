"""Serve flags, shared by `jaxserve serve` and `python -m jaxserve.entrypoints.openai.api_server`.

Every `EngineArgs` field is a flag (generated from the dataclass, so a new
field needs no edit here beyond an optional help line), plus the server's own
flags (`ServerArgs`). Precedence, lowest first:

    dataclass defaults  <  --config FILE.yaml  <  flags given on the command line

Flags default to `argparse.SUPPRESS`, so the namespace holds only what the user
typed; that is how an explicit flag is told apart from a default.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Literal, Union

import yaml

from jaxserve.engine.args import EngineArgs


@dataclass(frozen=True)
class ServerArgs:
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None  # every route but /health and /metrics then requires `Authorization: Bearer KEY`
    api_key_protects_metrics: bool = False  # /metrics too needs the key
    max_request_body_bytes: int = 16 * 1024 * 1024
    max_request_header_bytes: int = 64 * 1024  # larger request headers get a 431
    max_n_sequences: int = 16384  # n / best_of above it: a 400 (vLLM's VLLM_MAX_N_SEQUENCES default)
    shutdown_timeout: float = 0.0  # seconds in-flight requests get after SIGTERM/SIGINT, then abort (vLLM's)
    max_num_queued_reqs: int | None = None  # this many waiting beyond the free slots: a new one is a 503 (None: no cap)
    uvicorn_log_level: str = "info"
    trust_request_chat_template: bool = False  # else a request's chat_template is a 400 (vLLM's advisory)
    enable_auto_tool_choice: bool = False  # tool_choice "auto": parse calls with tool_call_parser
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # qwen3: <think>...</think> goes to message.reasoning
    # --lora-modules name=path or '{"name": ..., "path": ..., "base_model_name": ...}' (needs --enable-lora)
    lora_modules: tuple | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_request_body_bytes", "max_request_header_bytes", "max_n_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.shutdown_timeout >= 0:  # (NaN too)
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 0:
            raise ValueError(f"max_num_queued_reqs must be >= 0, got {self.max_num_queued_reqs}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("tool_call_parser is required with enable_auto_tool_choice")


@dataclass(frozen=True)
class ServeConfig:
    engine: EngineArgs
    server: ServerArgs


class ConfigError(ValueError):
    """A bad --config file or flag combination; the message names the key."""


_HELP = {
    "model": "model name, path or GGUF/safetensors directory (default: SmolLM2-135M-Instruct)",
    "served_model_name": ("the name clients pass as `model` (default: the model argument); several names: a request "
                          "may use any, responses carry the first"),
    "tokenizer": "a Hugging Face tokenizer directory (with its chat template) to use instead of the model's",
    "trust_remote_code": "accepted for vLLM's commands: no remote code is ever run (every architecture is built in)",
    "enforce_eager": "skip the start-up warm-up: each program compiles the first time a request needs it",
    "max_logprobs": "the most logprobs / prompt_logprobs a request may ask for (at most 20)",
    "generation_config": ("auto: the model's generation_config.json sampling defaults (temperature, top_p, top_k, "
                          "min_p, repetition_penalty, max_new_tokens) apply where a request leaves them unset; "
                          "vllm: ignore it; or a directory holding a generation_config.json"),
    "override_generation_config": "JSON, as vLLM: '{\"temperature\": 0.5}' laid over the generation config's defaults",
    "dtype": ("weights' dtype; auto: bfloat16 on accelerators, float32 on CPUs, where on one device of a "
              "CPU with bfloat16 dot instructions (AVX512_BF16, AMX) the projections of a step of 64+ tokens "
              "and the sampler's LM head are bfloat16 dots accumulated in float32 (about 1.3x, perplexity "
              "within 0.2 percent of float32); float32: float32 throughout"),
    "max_model_len": "context length: prompt plus completion (default: the model's, capped at 2048 on CPU)",
    "gpu_memory_utilization": "fraction of accelerator memory for weights, activations and the KV pool",
    "num_gpu_blocks_override": "KV blocks to allocate, skipping memory profiling",
    "kv_cache_memory": "bytes of KV pool (CPU; default 1 GiB)",
    "max_num_seqs": "most requests in one batch",
    "max_num_batched_tokens": "token budget of one engine step",
    "swap_space": "GiB of host memory for swapped-out KV blocks",
    "quantization": ("a checkpoint's method (awq, gptq, compressed-tensors, fp8; auto-detected from config.json) "
                     "or one applied at load: int8 (SmoothQuant W8A8, one device), fp8 (e4m3 weights, per-token "
                     "activations)"),
    "block_size": "tokens per KV block; None (not given): 64 on a CPU, 16 elsewhere",
    "kv_cache_dtype": ("KV pool dtype; auto: the model's; None (not given): bfloat16 on a CPU, auto elsewhere. bfloat16: half the bytes (not bit-exact); fp8 (= fp8_e4m3), "
                       "fp8_e5m2: a quarter of float32's, with the checkpoint's k/v scales when it has them"),
    "attention_backend": "auto: Pallas kernels on GPU, the XLA path on CPU (reference: old name of xla)",
    "enable_expert_parallel": ("MoE models: split the experts over the tensor-parallel devices (whole experts "
                               "per device, one psum a layer) instead of each expert's width"),
    "chat_template": "a Jinja chat template, or a file holding one, overriding the model's",
    "compilation_cache_dir": "JAX persistent compilation cache directory",
    "num_hosts": "processes (hosts) joined by jax.distributed into one replica (a TP mesh, or a PP stage per host); rank 0 serves HTTP",
    "host_rank": "this host's rank, 0 .. num_hosts - 1; None: from the cluster environment",
    "coordinator": "ADDR:PORT of rank 0's jax.distributed coordinator; None: $JAX_COORDINATOR_ADDRESS",
    "speculative_config": "JSON, as vLLM: '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' drafts "
                          "greedy requests' next tokens from their own earlier n-grams; on one CPU device "
                          "ngram with 4 tokens unless given; '{}': none",
    "runner": "auto: pooling for embedding/reranking models (encoders, sentence-transformers directories), else generate",
    "convert": "the pooling task: embed (/v1/embeddings) or classify (/score, /rerank); auto: the architecture's",
    "override_pooler_config": "JSON, as vLLM: '{\"pooling_type\": \"MEAN\", \"normalize\": true}' beats the model's pooler",
    "host": "address to bind",
    "port": "port to bind",
    "api_key": "require `Authorization: Bearer KEY` on every route but /health and /metrics",
    "api_key_protects_metrics": "with --api-key, /metrics needs the key too",
    "max_request_body_bytes": "larger request bodies get a 413",
    "max_request_header_bytes": "larger request headers (all of them together) get a 431",
    "max_n_sequences": "most parallel samples (n, best_of) one request may ask for; more is a 400",
    "shutdown_timeout": ("seconds in-flight requests may take to finish after SIGTERM/SIGINT (new ones get 503); "
                         "then what is left is aborted (finish_reason abort) and the server exits 0"),
    "max_num_queued_reqs": ("when this many requests already wait beyond the free --max-num-seqs slots, a new "
                            "one gets a 503 at once (None: no cap)"),
    "trust_request_chat_template": "render a chat_template sent in a request (off: such a request is a 400)",
    "enable_auto_tool_choice": "tool_choice auto: parse tool calls from the model's text (needs --tool-call-parser)",
    "tool_call_parser": "the model's tool-call format for tool_choice auto",
    "reasoning_parser": "split the model's <think> part into message.reasoning",
    "enable_lora": "serve LoRA adapters (PEFT directories) on the base model, batched together",
    "max_loras": "adapters in one batch (device slots)",
    "max_lora_rank": "the largest adapter rank (slots are padded to it)",
    "max_cpu_loras": "adapters kept in host memory (None: max_loras)",
    "lora_dtype": "the adapters' device dtype; auto: the model's",
    "lora_modules": "adapters served at start-up: name=path or JSON {\"name\", \"path\", \"base_model_name\"}",
    "enable_sleep_mode": ("serve the dev routes /sleep, /wake_up, /is_sleeping, /pause, /resume, /is_paused "
                          "(as VLLM_SERVER_DEV_MODE=1 does): free the KV pool and weights between RL steps"),
    "allowed_media_domains": ("host names http(s) image URLs (and their redirects) may name; without it any host "
                              "whose addresses are all public (private, loopback, link-local ones refused)"),
    "mm_processor_kwargs": "JSON, as vLLM: the image processor's options over the checkpoint's, '{\"max_pixels\": N}'",
    "mm_processor_cache_gb": "GiB of processed images kept by their pixels' hash (0: no cache)",
}
# Flags whose values are a set: EngineArgs' `Literal` fields add theirs (_field_types).
_CHOICES: dict[str, tuple] = {"uvicorn_log_level": ("critical", "error", "warning", "info", "debug", "trace"),
                              "tool_call_parser": ("hermes", "llama3_json", "mistral"), "reasoning_parser": ("qwen3",)}


def _base_type(annotation: object) -> object:
    """`int | None` -> int; the flag's value type (a `Literal[...]` stays as it is). `str | tuple[str, ...]`
    (--served-model-name, one or several values) -> tuple."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = next((a for a in args if a is tuple or typing.get_origin(a) is tuple), args[0])
    return tuple if typing.get_origin(annotation) is tuple else annotation


def _field_types(cls: type) -> dict[str, tuple[type, bool, object]]:
    """name -> (value type, accepts None, default) for a config dataclass; records `Literal` choices."""
    hints = typing.get_type_hints(cls)  # Annotated[...] constraints stripped: pydantic checks them
    specs = {}
    for f in fields(cls):
        base = _base_type(hints[f.name])
        if typing.get_origin(base) is Literal:
            _CHOICES[f.name] = typing.get_args(base)
            base = type(_CHOICES[f.name][0])
        specs[f.name] = (base, type(None) in typing.get_args(hints[f.name]),
                         None if f.default is MISSING else f.default)
    return specs


ENGINE_FIELDS = _field_types(EngineArgs)
SERVER_FIELDS = _field_types(ServerArgs)


def _add_fields(group: argparse._ArgumentGroup, specs: dict[str, tuple[type, bool, object]],
                skip: tuple[str, ...] = ()) -> None:
    for name, (kind, _, default) in specs.items():
        if name in skip:
            continue
        if kind is tuple:  # --lora-modules: several values
            group.add_argument("--" + name.replace("_", "-"), nargs="+", default=argparse.SUPPRESS,
                               help=_HELP.get(name, name))
            continue
        flag = "--" + name.replace("_", "-")
        help_text = f"{_HELP.get(name, name.replace('_', ' '))} (default: {default})"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=help_text)
        elif kind is dict:
            group.add_argument(flag, type=_json_object, default=argparse.SUPPRESS, metavar="JSON", help=help_text)
        else:
            group.add_argument(flag, type=kind, choices=_CHOICES.get(name), default=argparse.SUPPRESS,
                               metavar=None if name in _CHOICES else name.upper(), help=help_text)


def _json_object(value: str) -> dict:
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return obj


def add_serve_args(parser: argparse.ArgumentParser, *, positional_model: bool) -> argparse.ArgumentParser:
    """All serve flags; `jaxserve serve` also takes the model as an optional positional."""
    if positional_model:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=_HELP["model"])
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="defaults for any flag below (keys with dashes or underscores); flags override it")
    _add_fields(parser.add_argument_group("engine"), ENGINE_FIELDS)
    _add_fields(parser.add_argument_group("server"), SERVER_FIELDS)
    return parser


def _check_value(source: str, name: str, value: object, spec: tuple[type, bool, object]) -> object:
    kind, nullable, _ = spec
    if value is None and nullable:
        return None
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind in (int, float):
        ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    elif kind is tuple and isinstance(value, (list, str)):  # (one string: one value)
        value, ok = (tuple(value) if isinstance(value, list) else (value,)), True
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(f"{source}: {name} must be {kind.__name__}{' or null' if nullable else ''}, "
                          f"got {value!r}")
    if name in _CHOICES and value not in _CHOICES[name]:
        raise ConfigError(f"{source}: {name} must be one of {_CHOICES[name]}, got {value!r}")
    return float(value) if kind is float else value  # type: ignore[arg-type]  # checked above


def load_config_file(path: str) -> dict[str, object]:
    """A YAML mapping of flag names to values, with keys normalized to field names and types checked."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of flag names to values")
    known = {**ENGINE_FIELDS, **SERVER_FIELDS}
    values: dict[str, object] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(f"config file {path}: unknown key {key!r}")
        values[name] = _check_value(f"config file {path}", name, value, known[name])
    return values


def resolve(ns: argparse.Namespace) -> ServeConfig:
    """Merge defaults, the config file and explicit flags; raises ConfigError (or EngineArgs' ValueError)."""
    values = load_config_file(ns.config) if getattr(ns, "config", None) else {}
    explicit = {k: v for k, v in vars(ns).items() if k in ENGINE_FIELDS or k in SERVER_FIELDS}
    tag = getattr(ns, "model_tag", None)
    if tag is not None:
        if "model" in explicit and explicit["model"] != tag:
            raise ConfigError(f"model given twice: {tag!r} and --model {explicit['model']!r}")
        explicit["model"] = tag
    values.update(explicit)
    if values.get("lora_modules") is not None:
        values["lora_modules"] = tuple(values["lora_modules"])
    try:
        engine = EngineArgs(**{k: v for k, v in values.items() if k in ENGINE_FIELDS})
        server = ServerArgs(**{k: v for k, v in values.items() if k in SERVER_FIELDS})
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return ServeConfig(engine=engine, server=server)

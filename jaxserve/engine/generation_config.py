"""The model's recommended sampling defaults, as vLLM reads them (`--generation-config`).

vLLM (ModelConfig.get_diff_sampling_param) takes `generation_config.json` through transformers'
`GenerationConfig`, keeps the fields the file sets (`to_diff_dict`) among six sampling ones,
renames `max_new_tokens` to `max_tokens`, and lays `--override-generation-config` over them:

    auto   the model directory's generation_config.json (else the generation fields of its
           config.json, as GenerationConfig.from_model_config does; a GGUF file has neither)
    vllm   none: vLLM's own defaults (temperature 1, top_p 1, ...)
    DIR    DIR/generation_config.json

The defaults apply where a request leaves the field unset: an OpenAI request's omitted fields
(entrypoints/openai/protocol.py), `LLM.generate(prompts)` without SamplingParams
(`LLM.get_default_sampling_params`). A SamplingParams passed in is used as it is, as in vLLM.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from jaxserve.core.sampling_params import SamplingParams

log = logging.getLogger(__name__)
# vLLM's list (ModelConfig.get_diff_sampling_param); do_sample is not among them: vLLM ignores it.
SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def generation_defaults(mode: str, model_path: Path | None, override: dict | None = None) -> dict[str, object]:
    """SamplingParams field -> default, from `--generation-config MODE` and `--override-generation-config`.
    ValueError naming generation_config for a DIR without the file or values SamplingParams refuses."""
    config = {} if mode == "vllm" else _read(mode, model_path)
    config.update(override or {})
    defaults = {k: config[k] for k in SAMPLING_FIELDS if config.get(k) is not None}
    if "max_new_tokens" in defaults:  # transformers' name for vLLM's max_tokens
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:
        SamplingParams(**defaults)  # a bad file is a start-up error, not every request's 400
    except ValueError as exc:
        raise ValueError(f"generation_config: the model's sampling defaults {defaults} are refused: {exc}") from None
    if defaults:
        log.warning("Default sampling parameters %s come from the model's generation config (the values its "
                    "authors recommend), as in vLLM; --generation-config vllm ignores them", defaults)
    return defaults


def _read(mode: str, model_path: Path | None) -> dict[str, object]:
    """The fields the generation config sets (GenerationConfig.to_diff_dict, vLLM's reading)."""
    from transformers import GenerationConfig

    if mode == "auto":
        if model_path is None or not model_path.is_dir():
            return {}  # a GGUF file or a weights-only source: no generation config
        directory = model_path
    else:
        directory = Path(mode).expanduser()
        if not (directory / "generation_config.json").is_file():
            raise ValueError(f"generation_config: {mode!r} must be auto, vllm or a directory holding "
                             "generation_config.json")
    gen_file, config_file = directory / "generation_config.json", directory / "config.json"
    if gen_file.is_file():
        return GenerationConfig.from_dict(_json(gen_file)).to_diff_dict()
    if config_file.is_file():  # vLLM's fallback: GenerationConfig.from_model_config(config.json)
        return GenerationConfig.from_dict(_json(config_file), _from_model_config=True).to_diff_dict()
    return {}


def _json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"generation_config: cannot read {path}: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"generation_config: {path} must hold a JSON object")
    return obj

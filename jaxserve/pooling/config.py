"""Which runner a model gets, and its pooler, as vLLM decides them (no JAX here).

    runner:  auto -> "pooling" for an encoder or a bare decoder (`*Model`), or any model with
             sentence-transformers' modules.json; "generate" for a *ForCausalLM without it.
    convert: auto -> the architecture's task: "classify" for *ForSequenceClassification, else "embed".
    pooler:  the architecture's default  <  modules.json + 1_Pooling/config.json  <  --override-pooler-config
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from jaxserve.models.bert import ENCODER_ARCHITECTURES

POOLING_TYPES = ("CLS", "MEAN", "LAST")
# bare decoders (what sentence-transformers saves) -> the causal-LM class jaxserve's Llama code reads
DECODER_EMBEDDERS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                     "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
_ST_POOLING_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
                     "pooling_mode_lasttoken": "LAST"}
_OVERRIDE_KEYS = ("pooling_type", "normalize", "activation", "softmax", "use_activation", "dimensions")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "CLS"  # one of POOLING_TYPES
    normalize: bool = True  # L2-normalize embeddings
    activation: bool = True  # classify: softmax over the labels (sigmoid when there is one label)
    dimensions: int | None = None  # a default Matryoshka truncation

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {self.pooling_type!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")

    def with_overrides(self, override: dict | None) -> "PoolerConfig":
        if not override:
            return self
        unknown = set(override) - set(_OVERRIDE_KEYS)
        if unknown:
            raise ValueError(f"override_pooler_config: unknown key {sorted(unknown)[0]!r}; "
                             f"known: {', '.join(_OVERRIDE_KEYS)}")
        out = self
        if override.get("pooling_type") is not None:
            out = replace(out, pooling_type=str(override["pooling_type"]).upper())
        if override.get("normalize") is not None:
            out = replace(out, normalize=bool(override["normalize"]))
        for key in ("activation", "softmax", "use_activation"):
            if override.get(key) is not None:
                out = replace(out, activation=bool(override[key]))
        if override.get("dimensions") is not None:
            out = replace(out, dimensions=int(override["dimensions"]))
        return out


@dataclass(frozen=True)
class PoolingModelInfo:
    """What the model directory says about pooling, read before any weight."""
    runner: str  # "generate" | "pooling"
    task: str | None  # "embed" | "classify" (pooling only)
    architecture: str | None
    pooler: PoolerConfig
    max_seq_length: int | None = None  # sentence_bert_config.json's
    matryoshka_dimensions: tuple[int, ...] | None = None  # None: not a Matryoshka model
    score_activation: bool = True  # cross-encoder scores through a sigmoid (sentence-transformers' default)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict) and not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def sentence_transformers_pooler(model_dir: Path) -> PoolerConfig | None:
    """modules.json's Pooling (+ Normalize) modules as a PoolerConfig; None without modules.json."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return None
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_path}: expected a list of modules")
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    normalize = "Normalize" in types
    if "Pooling" not in types:
        return None
    pooling_cfg = _read_json(model_dir / str(types["Pooling"].get("path", "1_Pooling")) / "config.json")
    modes = [mode for key, mode in _ST_POOLING_MODES.items() if pooling_cfg.get(key)]
    if isinstance(pooling_cfg.get("pooling_mode"), str):  # newer sentence-transformers: one string
        modes = [{"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}.get(pooling_cfg["pooling_mode"], "?")]
    if len(modes) != 1:
        raise ValueError(f"{model_dir}: sentence-transformers pooling {pooling_cfg!r} is not one of CLS, MEAN, LAST")
    return PoolerConfig(pooling_type=modes[0], normalize=normalize)


def read_pooling_info(model_path: Path, runner: str = "auto", convert: str = "auto",
                      override_pooler_config: dict | None = None) -> PoolingModelInfo:
    """The runner and pooler for `model_path`; ValueError naming the flag when they do not fit."""
    hf = _read_json(model_path / "config.json") if model_path.is_dir() and (model_path / "config.json").is_file() else {}
    archs = list(hf.get("architectures") or [])
    arch = archs[0] if archs else None
    st_pooler = sentence_transformers_pooler(model_path) if model_path.is_dir() else None
    is_encoder = arch in ENCODER_ARCHITECTURES
    pooling_native = is_encoder or arch in DECODER_EMBEDDERS
    if runner == "generate":
        if pooling_native:
            raise ValueError(f"runner: {arch} is a pooling model (embeddings, scores); it cannot run with "
                             "--runner generate (use --runner pooling)")
        return PoolingModelInfo("generate", None, arch, PoolerConfig())
    if runner == "auto" and not (pooling_native or st_pooler is not None or convert != "auto"):
        return PoolingModelInfo("generate", None, arch, PoolerConfig())
    if arch is None:
        raise ValueError(f"runner: pooling needs an HF model directory with a config.json; got {model_path}")
    task = ENCODER_ARCHITECTURES[arch][1] if is_encoder else "embed"
    if convert != "auto":
        if convert == "classify" and task != "classify":
            raise ValueError(f"convert: classify needs a classification head; {arch} has none")
        task = convert
    default = PoolerConfig(pooling_type="CLS" if is_encoder else "LAST", normalize=True)
    pooler = (st_pooler or default).with_overrides(override_pooler_config)
    st_cfg = model_path / "sentence_bert_config.json"
    max_seq = _read_json(st_cfg).get("max_seq_length") if st_cfg.is_file() else None
    dims = hf.get("matryoshka_dimensions")
    matryoshka = tuple(int(d) for d in dims) if isinstance(dims, list) else (() if hf.get("is_matryoshka") else None)
    st_extra = dict(hf.get("sentence_transformers") or {})  # older CrossEncoders: in config.json
    st_file = model_path / "config_sentence_transformers.json"
    if st_file.is_file():
        st_extra.update(_read_json(st_file))
    act = str(st_extra.get("activation_fn") or "Sigmoid")
    return PoolingModelInfo("pooling", task, arch, pooler, int(max_seq) if max_seq else None, matryoshka,
                            score_activation=act.endswith("Sigmoid"))

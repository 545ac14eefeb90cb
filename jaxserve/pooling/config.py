"""Which runner a model gets, and its pooler, as vLLM decides them (no JAX here).

    runner:  auto -> "pooling" for an encoder or a bare decoder (`*Model`), or any model with
             sentence-transformers' modules.json; "generate" for a *ForCausalLM without it.
    convert: auto -> the architecture's task: "classify" for *ForSequenceClassification, else "embed".
    pooler:  the architecture's default  <  modules.json + 1_Pooling/config.json  <  --override-pooler-config

modules.json is read whole at start-up: Transformer (its max_seq_length and do_lower_case), Pooling
(every mode sentence-transformers has), then Dense and Normalize in their order (run on the host by
pooler.Pooler). Any other module is a ValueError naming it: dropping one would give wrong embeddings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from jaxserve.models.bert import ENCODER_ARCHITECTURES

# LAST is sentence-transformers' "lasttoken"; the others are its mode names upper-cased.
POOLING_TYPES = ("CLS", "MEAN", "MAX", "LAST", "WEIGHTEDMEAN", "MEAN_SQRT_LEN_TOKENS")
# bare decoders (what sentence-transformers saves) -> the causal-LM class jaxserve's Llama code reads
DECODER_EMBEDDERS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                     "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
_ST_MODES = {"cls": "CLS", "mean": "MEAN", "max": "MAX", "lasttoken": "LAST", "weightedmean": "WEIGHTEDMEAN",
             "mean_sqrt_len_tokens": "MEAN_SQRT_LEN_TOKENS"}
# sentence-transformers < 6 saved one boolean per mode (in this order, which is its concatenation order)
_ST_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                    "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
ST_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")  # the module types jaxserve runs
_ST_CONFIG_FILES = ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
                    "sentence_camembert_config.json", "sentence_albert_config.json",
                    "sentence_xlm-roberta_config.json", "sentence_xlnet_config.json")  # vLLM's list
_UNSET_MAX_LENGTH = 10 ** 9  # transformers writes int(1e30) as model_max_length when none was set
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
    do_lower_case: bool = False  # sentence_bert_config.json's: texts are lower-cased before tokenizing (vLLM)
    # modules.json's modules after Pooling, in order: ("Dense", "2_Dense"), ("Normalize", "3_Normalize")
    st_modules: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class STPipeline:
    """A sentence-transformers modules.json, checked (no weights read)."""
    pooler: PoolerConfig | None  # None: no Pooling module (a CrossEncoder saves a Transformer only)
    modules: tuple[tuple[str, str], ...]  # (type, folder) of the Dense / Normalize modules after Pooling
    max_seq_length: int | None
    do_lower_case: bool


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict) and not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _st_modes(cfg: dict, where: Path) -> str:
    """1_Pooling/config.json -> one of POOLING_TYPES (either format sentence-transformers writes)."""
    mode = cfg.get("pooling_mode")
    if mode is None:  # < 6: booleans; none set means mean, as sentence-transformers loads it
        mode = [m for key, m in _ST_LEGACY_MODES.items() if cfg.get(key)] or ["mean"]
    modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1:
        raise ValueError(f"{where}: pooling modes {modes} are concatenated; jaxserve pools with one mode")
    if modes[0] not in _ST_MODES:
        raise ValueError(f"{where}: unknown sentence-transformers pooling mode {modes[0]!r}; "
                         f"known: {', '.join(_ST_MODES)}")
    return _ST_MODES[modes[0]]


def _st_transformer(model_dir: Path, folder: str) -> tuple[int | None, bool]:
    """The Transformer module's max_seq_length and do_lower_case. sentence-transformers < 6 wrote both to
    sentence_bert_config.json; 6 keeps max_seq_length as the tokenizer's model_max_length (and bakes
    lower-casing into tokenizer.json, which the tokenizer then does itself)."""
    if folder not in ("", "."):
        raise ValueError(f"{model_dir}: modules.json's Transformer is in the subfolder {folder!r}; jaxserve reads "
                         "the transformer from the model directory itself")
    st_cfg = next((read_json(model_dir / n) for n in _ST_CONFIG_FILES if (model_dir / n).is_file()), {})
    max_seq = st_cfg.get("max_seq_length")
    tok_cfg = model_dir / "tokenizer_config.json"
    if max_seq is None and tok_cfg.is_file():
        tok_max = read_json(tok_cfg).get("model_max_length")
        max_seq = tok_max if isinstance(tok_max, int) and tok_max < _UNSET_MAX_LENGTH else None
    return (int(max_seq) if max_seq else None), bool(st_cfg.get("do_lower_case", False))


def _st_module_config(model_dir: Path, kind: str, folder: str) -> None:
    """Dense / Normalize must act on the pooled row (not on token embeddings, as ColBERT-style models do)."""
    cfg_path = model_dir / folder / "config.json"
    cfg = read_json(cfg_path) if cfg_path.is_file() else {}
    for key in ("module_input_name", "module_output_name"):
        if cfg.get(key, "sentence_embedding") not in (None, "sentence_embedding"):
            raise ValueError(f"{cfg_path}: {kind} with {key}={cfg[key]!r} is not supported (jaxserve runs "
                             f"{kind} on the pooled sentence embedding only)")


def read_st_pipeline(model_dir: Path) -> STPipeline | None:
    """modules.json, every module checked in order; None without modules.json."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return None
    modules = read_json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{modules_path}: expected a list of modules")
    pooler, after, max_seq, lower = None, [], None, False
    for i, m in enumerate(sorted(modules, key=lambda m: int(m.get("idx", 0)))):
        full, folder = str(m.get("type", "")), str(m.get("path", ""))
        kind = full.rsplit(".", 1)[-1]
        if kind not in ST_MODULES:
            raise ValueError(f"{model_dir}: modules.json has the sentence-transformers module {full!r} "
                             f"({folder or 'no folder'}), which jaxserve does not run (it runs "
                             f"{', '.join(ST_MODULES)}); serving without it would give wrong embeddings")
        if (kind == "Transformer") != (i == 0):
            raise ValueError(f"{modules_path}: the Transformer module must come first, and only once")
        if kind == "Transformer":
            max_seq, lower = _st_transformer(model_dir, folder)
        elif kind == "Pooling":
            if pooler is not None or after:
                raise ValueError(f"{modules_path}: a Pooling module after Pooling, Dense or Normalize")
            pooler = PoolerConfig(pooling_type=_st_modes(read_json(model_dir / folder / "config.json"),
                                                         model_dir / folder / "config.json"), normalize=False)
        else:
            if pooler is None:
                raise ValueError(f"{modules_path}: {kind} ({folder}) before the Pooling module acts on token "
                                 "embeddings, which jaxserve does not serve")
            _st_module_config(model_dir, kind, folder)
            after.append((kind, folder))
    if pooler is not None:
        pooler = replace(pooler, normalize=any(kind == "Normalize" for kind, _ in after))
    return STPipeline(pooler, tuple(after), max_seq, lower)


def read_pooling_info(model_path: Path, runner: str = "auto", convert: str = "auto",
                      override_pooler_config: dict | None = None) -> PoolingModelInfo:
    """The runner and pooler for `model_path`; ValueError naming the flag when they do not fit."""
    hf = read_json(model_path / "config.json") if model_path.is_dir() and (model_path / "config.json").is_file() else {}
    archs = list(hf.get("architectures") or [])
    arch = archs[0] if archs else None
    st = read_st_pipeline(model_path) if model_path.is_dir() and runner != "generate" else None
    st_pooler = st.pooler if st is not None else None
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
    max_seq = st.max_seq_length if st is not None else None
    dims = hf.get("matryoshka_dimensions")
    matryoshka = tuple(int(d) for d in dims) if isinstance(dims, list) else (() if hf.get("is_matryoshka") else None)
    st_extra = dict(hf.get("sentence_transformers") or {})  # older CrossEncoders: in config.json
    st_file = model_path / "config_sentence_transformers.json"
    if st_file.is_file():
        st_extra.update(read_json(st_file))
    act = str(st_extra.get("activation_fn") or "Sigmoid")
    return PoolingModelInfo("pooling", task, arch, pooler, max_seq, matryoshka,
                            score_activation=act.endswith("Sigmoid"), do_lower_case=st is not None and st.do_lower_case,
                            st_modules=st.modules if st is not None and task == "embed" else ())

"""Load a llama.cpp GGUF file: config from its metadata, weights dequantized by the `gguf` package.

llama.cpp's converter permutes the rows of q and k for the `llama` architecture
(to its interleaved RoPE layout); we undo that so the weights match the
transformers (rotate-half) convention the model uses.

`gguf.GGUFReader` parses every metadata array element by element: opening
SmolLM2's file (a 49k-token vocabulary and its merges) takes about 4 s, on every
start-up. So the first load writes an index of what loading needs (the config
and each tensor's type, shape and offset) beside the file, as the tokenizer is
cached there, and later loads read the tensors through one memory map of the
file, with no GGUFReader at all.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import Params
from jaxserve.weights import gguf_families, gguf_gemma
from jaxserve.weights.assemble import PlaceFn, assemble_params

if TYPE_CHECKING:  # the gguf package is imported where a GGUF file is read (the GPU image lacks it)
    from gguf import GGMLQuantizationType, GGUFReader

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                      "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
GGUF_ARCHITECTURES.update(gguf_families.ARCHITECTURES)  # phi3, olmo2, granite
GGUF_ARCHITECTURES.update(gguf_gemma.ARCHITECTURES)  # gemma2, gemma3
PERMUTED_ARCHITECTURES = ("llama", "mistral", *gguf_families.PERMUTED)

# transformers name (under model.layers.{i}.) -> GGUF name (under blk.{i}.)
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


INDEX_FORMAT = 1


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # a read-only view of the file, shaped and typed as GGUFReader gives it


@dataclass(frozen=True)
class GGUFHeader:
    """What loading needs of a GGUF file's header."""
    config: ModelConfig
    architecture: str
    tensors: dict[str, GGUFTensor]


def cache_path(path: Path, kind: str) -> Path:
    """Where a cache derived from the GGUF file at `path` lives: beside it (`.NAME.KIND-KEY`), or
    as ~/.cache/jaxserve/gguf/NAME.KIND-KEY when that folder is read-only. KEY follows the
    file's resolved path, size and modification time, so an edited or replaced file gets a new one."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    if os.access(path.parent, os.W_OK):
        return path.parent / f".{path.name}.{kind}-{key}"
    return Path(os.path.expanduser("~/.cache/jaxserve/gguf")) / f"{path.name}.{kind}-{key}"


def read_header(path: Path) -> tuple[GGUFHeader, GGUFReader | None]:
    """The file's config and tensors: from its index when an earlier load wrote one, else parsed
    by GGUFReader (returned too, for the tokenizer; None on an index hit) and indexed."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    index = cache_path(path, "index")
    header = _read_index(path, index)
    if header is not None:
        return header, None
    reader = open_gguf(path)
    header = GGUFHeader(read_config(reader, path), field(reader, "general.architecture"),
                        {t.name: GGUFTensor(t.name, t.tensor_type, t.data) for t in reader.tensors})
    entries = [[t.name, int(t.tensor_type), t.data.dtype.str, list(t.data.shape), int(t.data_offset)]
               for t in reader.tensors]
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_name(f"{index.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": INDEX_FORMAT, "config": header.config.to_dict(),
                                   "architecture": header.architecture, "tensors": entries}))
        os.replace(tmp, index)
    except OSError:
        pass  # a read-only place: parse again next time, still correct
    return header, reader


def _read_index(path: Path, index: Path) -> GGUFHeader | None:
    """The header from `index`; None when there is none, or it is unreadable or from another format."""
    try:
        d = json.loads(index.read_text())
        if d.get("format") != INDEX_FORMAT:
            return None
        from gguf import GGMLQuantizationType

        raw = np.memmap(path, np.uint8, mode="r")
        tensors = {}
        for name, qtype, dtype, shape, offset in d["tensors"]:
            dt = np.dtype(dtype)
            size = int(np.prod(shape)) * dt.itemsize
            if offset + size > raw.size:
                return None
            tensors[name] = GGUFTensor(name, GGMLQuantizationType(qtype),
                                       raw[offset:offset + size].view(dt).reshape(shape))
        return GGUFHeader(ModelConfig.from_dict(d["config"]), d["architecture"], tensors)
    except (OSError, ValueError, KeyError, TypeError):
        return None


class UnknownGGUFTypeError(ValueError):
    """A tensor's GGML type id is one the installed gguf package does not know."""


def _check_tensor_types(path: Path, fields: list) -> None:
    """Name the first tensor whose type id gguf does not know (GGUFReader would fail on it with a bare
    "N is not a valid GGMLQuantizationType")."""
    import gguf
    from gguf import GGMLQuantizationType

    known = {int(t) for t in GGMLQuantizationType}
    for f in fields:
        try:
            name, type_id = bytes(f.parts[1]).decode("utf-8", "replace"), int(f.parts[4][0])
        except (AttributeError, IndexError, TypeError, ValueError):
            return  # another gguf version lays tensor infos out otherwise: let the reader decide
        if type_id not in known:
            version = getattr(gguf, "__version__", None) or "installed"
            raise UnknownGGUFTypeError(
                f"{path}: tensor {name!r} has GGML type id {type_id}, which the {version} gguf package does not "
                "know (a newer llama.cpp quantization?); re-quantize the file to a common type (Q4_K_M, Q8_0, ...) "
                "or upgrade gguf")


def open_gguf(path: Path) -> GGUFReader:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    from gguf import GGUFReader

    class _Reader(GGUFReader):  # names a tensor of an unknown type before the reader trips on it
        def _build_tensors(self, start_offs, fields, *args, **kwargs):
            _check_tensor_types(path, fields)
            return super()._build_tensors(start_offs, fields, *args, **kwargs)

    try:
        return _Reader(str(path))
    except UnknownGGUFTypeError:
        raise
    except Exception as e:  # the reader raises ValueError/struct errors on truncated or foreign files
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader: GGUFReader, path: Path) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{path}: precomputed RoPE frequency factors (rope_freqs.weight, llama3 scaling "
                         "in GGUF form) are not supported yet; load the HF-format directory instead")
    hidden = int(field(reader, f"{arch}.embedding_length"))
    num_heads = int(field(reader, f"{arch}.attention.head_count"))
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    eot = field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(x) for x in (eos, eot) if x is not None))
    scaling_type = field(reader, f"{arch}.rope.scaling.type", "none")
    rope_type, rope_scaling = "default", ()
    if scaling_type == "linear":
        rope_type, rope_scaling = "linear", (float(field(reader, f"{arch}.rope.scaling.factor")),)
    elif scaling_type not in ("none", None):
        raise ValueError(f"{path}: unsupported RoPE scaling {scaling_type!r}")
    sliding = field(reader, f"{arch}.attention.sliding_window")
    extra = gguf_families.config_fields(arch, reader, lambda key, default=None: field(reader, key, default),
                                        int(field(reader, f"{arch}.attention.key_length", hidden // num_heads)), path)
    rope_type, rope_scaling = extra.pop("rope_type", rope_type), extra.pop("rope_scaling", rope_scaling)
    extra.update(gguf_gemma.config_fields(arch, lambda key, default=None: field(reader, key, default), tokens))
    eos_ids += tuple(i for i in extra.pop("extra_eos_ids", ()) if i not in eos_ids)  # Gemma's <end_of_turn>
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(field(reader, f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_type=rope_type,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        **extra,
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: rows [h, 2, d/2] were written as [h, d/2, 2]."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(arch: str, hf_name: str) -> str:
    """The GGUF tensor name of a transformers name (KeyError when there is none)."""
    if hf_name.startswith("model.layers."):
        _, _, i, rest = hf_name.split(".", 3)
        name = gguf_families.layer_name(arch, rest) or gguf_gemma.layer_name(arch, rest) or _LAYER_NAMES[rest]
        return f"blk.{i}.{name}"
    return _GLOBAL_NAMES[hf_name]


def permuted_heads(cfg: ModelConfig, arch: str, name: str, rows: int) -> int | None:
    """The head count whose rows llama.cpp permuted in tensor `name`, or None (not permuted)."""
    if arch in PERMUTED_ARCHITECTURES and name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = cfg.num_heads if "attn_q" in name else cfg.num_kv_heads
        if rows == heads * cfg.head_dim:  # otherwise the shape check names the tensor
            return heads
    return None


def load_gguf(header: GGUFHeader, path: Path, dtype: jnp.dtype, progress: bool = True,
              place_leaf: PlaceFn | None = None, linear=None) -> Params:
    """The params; `linear` (--quantization gguf: weights/gguf_linear.packed_reader's reader, made by the
    caller): quantized projections and LM head stay as their blocks (quantization/gguf_packed.py), the
    rest is dequantized as without it."""
    from gguf.quants import dequantize

    cfg, arch, tensors = header.config, header.architecture, header.tensors

    def get(hf_name: str) -> np.ndarray:
        name = gguf_name(arch, hf_name)
        t = tensors.get(name)
        if t is None:
            raise KeyError(hf_name)
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: tensor {name!r} has quant type {t.tensor_type.name}, which "
                             f"the gguf package cannot dequantize ({e})") from None
        heads = permuted_heads(cfg, arch, name, w.shape[0])
        if heads is not None:
            w = _unpermute(w, heads)
        return gguf_gemma.from_gguf(arch, name, w)  # Gemma's norms: 1 + w back to w

    return assemble_params(cfg, get, dtype, str(path), progress, place_leaf, linear)

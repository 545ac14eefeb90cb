"""`--quantization gguf`: the reader that keeps a GGUF's quantized projections as their blocks.

weights/assemble.py asks a `linear` reader for each layer's projections and the untied LM head;
this one answers with quantization/gguf_packed.GGUFWeight for a tensor whose layers are all of a
packed type (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K), and None (read float, as without the
flag) for the rest: float tensors, other block types, norms and biases. The token embedding is kept
as its blocks too (a PackedEmbedding: the lookup widens the rows it gathers), and a tied LM head
is that same weight.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxserve.quantization.gguf_packed import PACKED_TYPES, GGUFWeight, PackedEmbedding, pack, take_rows
from jaxserve.weights.gguf_file import GGUFHeader, _unpermute, gguf_name, permuted_heads

_LAYER = re.compile(r"^blk\.\d+\.")


def packed_reader(header: GGUFHeader, path: Path,
                  dtype: jnp.dtype) -> Callable[[str, tuple[int, int]], GGUFWeight | PackedEmbedding | None]:
    """reader(prefix, (K, N)) -> the tensor `prefix`.weight as a host GGUFWeight, or None when it
    (or the same tensor of another layer: a layer stack holds one form) is of a type not packed.
    The embedding (prefix model.embed_tokens, shape (vocab, hidden)) comes as a PackedEmbedding
    whose rows widen to `dtype`."""
    cfg, arch, tensors = header.config, header.architecture, header.tensors

    def packable(name: str) -> bool:
        t = tensors.get(name)
        return t is not None and t.tensor_type.name in PACKED_TYPES

    def whole_leaf(name: str) -> bool:
        if not _LAYER.match(name):
            return packable(name)
        return all(packable(_LAYER.sub(f"blk.{i}.", name)) for i in range(cfg.num_layers))

    def reader(prefix: str, shape: tuple[int, int]) -> GGUFWeight | PackedEmbedding | None:
        if prefix == "model.embed_tokens":
            w = reader("lm_head.embed", shape[::-1])
            return None if w is None else PackedEmbedding(w, dtype)
        try:
            name = "token_embd.weight" if prefix == "lm_head.embed" else gguf_name(arch, f"{prefix}.weight")
        except KeyError:
            return None
        if not whole_leaf(name):
            return None
        t = tensors[name]
        k, n = shape
        if t.data.shape[0] != n:
            raise ValueError(f"{path}: tensor {name!r} has {t.data.shape[0]} rows, expected {n}")
        w = pack(t.data, t.tensor_type.name, n, k)
        heads = permuted_heads(cfg, arch, name, n)
        return w if heads is None else take_rows(w, _unpermute(np.arange(n), heads))

    reader.reads_head = True  # type: ignore[attr-defined]
    return reader

"""AWQ / GPTQ / compressed-tensors checkpoints of MoE models are refused at load with a ValueError
naming what MoE experts load from (block-wise fp8, mxfp4, float), before any tensor is read; the
same formats on a dense model still load. The checkpoints: tiny random models saved by
transformers, every Linear (attention and each expert's w1/w2/w3) replaced by the format's
tensors (tests/quant_fixtures.py, as tests/test_quantized_checkpoints.py makes them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import torch
import transformers

from safetensors.torch import load_file, save_file  # noqa: E402

from jaxserve.quantization import QuantizedWeight  # noqa: E402
from jaxserve.weights.loader import load_model  # noqa: E402
from tests import quant_fixtures as qf  # noqa: E402
from tests.moe_fixtures import save_checkpoint  # noqa: E402

FORMATS = {  # method -> (quantization_config, per-Linear maker (w [out, in], rng) -> tensors)
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
             lambda w, r: qf.gptq_linear(w, 4, 32, True, False, r)[0]),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
            lambda w, r: qf.awq_linear(w, 32, r)[0]),
    "compressed-tensors": (qf.ct_config("W4A16", 32), lambda w, r: qf.ct_linear(w, "W4A16", 32)[0]),
}
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|"
                    r"(block_sparse_moe|mlp)\.experts\.\d+\.w[123])\.weight$")


def quantize_dir(src: Path, out: Path, method: str) -> Path:
    """`src` (a float checkpoint) with every Linear in `method`'s tensors and its quantization_config."""
    qconfig, maker = FORMATS[method]
    rng = np.random.default_rng(0)
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if not LINEAR.match(name):
            tensors[name] = t
            continue
        prefix = name.removesuffix(".weight")
        for k, v in maker(t.float().numpy(), rng).items():
            tensors[f"{prefix}.{k}"] = torch.as_tensor(np.asarray(v)).contiguous()
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    return out


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_quant")
    moe_dir = save_checkpoint("mixtral", root / "mixtral")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "llama")
    return root, moe_dir, root / "llama"


@pytest.mark.parametrize("method", list(FORMATS))
def test_moe_experts_in_int_formats_are_refused_dense_loads(float_dirs, method):
    root, moe_dir, dense_dir = float_dirs
    tag = method.replace("-", "_")
    moe_q = quantize_dir(moe_dir, root / f"mixtral_{tag}", method)
    assert any(".experts.0.w1." in n for n in load_file(moe_q / "model.safetensors"))  # per-expert tensors
    with pytest.raises(ValueError, match=rf"quantization: {method} \(w4a16\) checkpoints are not supported for "
                                         r"MoE experts.*block-wise fp8.*mxfp4.*float"):
        load_model(str(moe_q), "float32", progress=False)
    with pytest.raises(ValueError, match="not supported for MoE experts"):  # named explicitly, as --quantization
        load_model(str(moe_q), "float32", progress=False, quantization=method)
    dense = load_model(str(quantize_dir(dense_dir, root / f"llama_{tag}", method)), "float32", progress=False,
                       quantization=method)
    wq = dense.params["layers"]["wq"]
    assert dense.quantization == method and isinstance(wq, QuantizedWeight) and wq.scheme == "w4a16"


def test_engine_refuses_before_serving(float_dirs):
    from jaxserve import LLM

    root, moe_dir, _ = float_dirs
    path = root / "mixtral_gptq" if (root / "mixtral_gptq").exists() else quantize_dir(moe_dir, root / "mixtral_gptq",
                                                                                       "gptq")
    with pytest.raises(ValueError, match="not supported for MoE experts"):
        LLM(str(path), dtype="float32", max_model_len=64, max_num_seqs=2, progress=False)

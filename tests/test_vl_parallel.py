"""Qwen2.5-VL under tensor parallelism and through the weights API, against transformers (tests/vl_fixtures.py's
tiny checkpoint).

    TP 2          2 fake CPU devices (tests/vl_worker.py): two images of different sizes in one prompt, one
                  image in another and a text-only prompt in one batch: greedy tokens equal transformers'
                  float32 ones, logprobs within 1e-4; the language model split, the tower replicated; the
                  same engine behind the real OpenAI app: a chat with an image over HTTP = transformers
    get_weights   the checkpoint's safetensors names (language model and visual.*), values equal
    update        perturbed tower weights by name: the same image (its rows cached before) now gives
                  transformers' tokens on the perturbed model; update_weights_from_disk restores them
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.logprob_parity import assert_logprobs_close, generated_logprobs
from tests.moe_fixtures import EXACT
from tests.vl_fixtures import hf_generate, image, save_vl_checkpoint
from tests.worker_run import run_json_worker

MAX_TOKENS = 6
ONE = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\nA <|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|><|vision_end|>?"
TEXT = "<|im_start|>user\nno image here<|im_end|>\n"


def prompts() -> list[tuple[str, list]]:
    """(prompt, images): 6x8 and 4x4 patch grids in one prompt, an 8x6 one alone, no image."""
    return [(TWO, [image(84, 112, 0), image(56, 56, 1)]), (ONE, [image(112, 84, 2)]), (TEXT, [])]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_vl_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("vl_tp") / "qwen2_5_vl")


@pytest.mark.multidevice
def test_tensor_parallel_equals_transformers(checkpoint):
    refs = [hf_generate(checkpoint, p, imgs, MAX_TOKENS) for p, imgs in prompts()]
    got = run_json_worker("vl_worker", str(checkpoint), "2", devices=2)
    assert got["devices"] == 2
    assert "model" in got["wq_spec"]  # the language model is split over the model axis
    assert got["vision_devices"] == 2 and "model" not in got["vision_spec"]  # the tower whole on each device
    assert got["prompt_ids"] == [r[0] for r in refs]
    assert got["tokens"] == [r[1] for r in refs]
    assert_logprobs_close(got["logprobs"], [r[2] for r in refs])
    # over HTTP (the real app, the same TP 2 engine): a chat whose ChatML is prompts()[1]'s prompt
    from transformers import AutoTokenizer

    http = got["http"]
    assert http["usage"]["prompt_tokens"] == len(refs[1][0]) and http["usage"]["completion_tokens"] == MAX_TOKENS
    assert http["text"] == AutoTokenizer.from_pretrained(checkpoint).decode(refs[1][1], skip_special_tokens=True)
    assert_logprobs_close([http["logprobs"]], [refs[1][2]])


def _generate(llm, prompt: str, images: list, max_tokens: int) -> list[int]:
    from jaxserve.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": images}}], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), generated_logprobs(out.outputs[0])


def test_weights_api_covers_the_vision_tower(checkpoint, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxserve import LLM
    from jaxserve.weights.hf_names_vl import canonical

    on_disk = load_file(str(checkpoint / "model.safetensors"))
    picture = image(84, 112, 0)
    with LLM(str(checkpoint), progress=False, enforce_eager=True, max_model_len=128, max_num_seqs=4,
             max_num_batched_tokens=64, kv_cache_memory=1 << 20, compilation_cache_dir="", **EXACT) as llm:
        weights = llm.get_weights()
        assert sorted(weights) == sorted(on_disk)  # visual.* and the language model's, as the file names them
        for name, value in on_disk.items():
            np.testing.assert_array_equal(np.asarray(weights[name]), value, err_msg=name)
        original = _generate(llm, ONE, [picture], 4)  # the image's rows now in the encoder cache

        # the tower perturbed: a block's qkv, the merger's last Linear (transformers 5's name), the patch embedding
        rng = np.random.RandomState(0)
        new = {"visual.blocks.0.attn.qkv.weight": on_disk["visual.blocks.0.attn.qkv.weight"] * 1.5,
               "model.visual.merger.mlp.2.weight": on_disk["visual.merger.mlp.2.weight"] + rng.randn(
                   *on_disk["visual.merger.mlp.2.weight"].shape).astype(np.float32),
               "visual.patch_embed.proj.weight": -on_disk["visual.patch_embed.proj.weight"]}
        perturbed = tmp_path / "perturbed"  # the checkpoint with the new tensors, for transformers
        shutil.copytree(checkpoint, perturbed)
        save_file({**on_disk, **{canonical(k): v for k, v in new.items()}}, str(perturbed / "model.safetensors"),
                  metadata={"format": "pt"})
        want = hf_generate(perturbed, ONE, [picture], 4)

        with pytest.raises(ValueError, match="visual.blocks.9.attn.qkv.weight: not a parameter"):
            llm.update_weights({"visual.blocks.9.attn.qkv.weight": new["visual.blocks.0.attn.qkv.weight"]})
        with pytest.raises(ValueError, match="visual.merger.mlp.2.weight: shape"):
            llm.update_weights({"visual.merger.mlp.2.weight": on_disk["visual.merger.mlp.2.weight"].T})
        assert _generate(llm, ONE, [picture], 4) == original  # refused: nothing changed
        llm.update_weights(new, version=1)
        tokens, logprobs = _generate(llm, ONE, [picture], 4)
        assert tokens == want[1] != original[0]
        assert_logprobs_close([logprobs], [want[2]])
        np.testing.assert_array_equal(np.asarray(llm.get_weights()["visual.merger.mlp.2.weight"]),
                                      new["model.visual.merger.mlp.2.weight"])
        llm.update_weights_from_disk(str(checkpoint), version=2)
        assert _generate(llm, ONE, [picture], 4) == original

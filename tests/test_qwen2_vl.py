"""Images in: Qwen2.5-VL and Qwen2-VL against transformers, on tiny random checkpoints saved by transformers'
own classes with their image processor beside them (tests/vl_fixtures.py).

    the vision tower     models/vision/qwen2_vl_vision.py against transformers' visual model, four images
                         of different sizes in one ragged batch (Qwen2.5-VL's windows and full blocks), one
                         of them across a key chunk's end (full attention's online softmax)
    M-RoPE               multimodal/inputs.rope_index against transformers' get_rope_index
    LLM.generate         {"prompt", "multi_modal_data": {"image": ...}}: greedy tokens equal to transformers'
                         float32 ones, each token's logprob within 1e-4, images of several sizes, two in one
                         prompt and a text-only prompt in one batch; Qwen2.5-VL with chunks of 32 tokens that
                         split images, Qwen2-VL with the prefix cache on and the same text with two images,
                         and once through AsyncLLM
    LLM.chat             an image_url part with a data: URL, through the chat template
    bad input            a ValueError naming the field, before any step
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.logprob_parity import assert_logprobs_close, generated_logprobs
from tests.moe_fixtures import EXACT
from tests.vl_fixtures import IDS, hf_generate, hf_model, image, save_vl_checkpoint

KINDS = ("qwen2_5_vl", "qwen2_vl")
MAX_TOKENS = 6
ONE = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\nA <|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|><|vision_end|>?"
TEXT = "<|im_start|>user\nno image here<|im_end|>\n"
# 6x8, 4x4 and 8x6 patch grids (12, 4 and 12 rows); SAME_SIZE: 6x8 again, other pixels
IMAGES = [image(84, 112, 0), image(56, 56, 1), image(112, 84, 2)]
SAME_SIZE = image(84, 112, 3)
BIG = image(364, 420, 4)  # 26x30 patches: larger than one key chunk of full attention (the tower test)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vl")
    return {kind: save_vl_checkpoint(kind, root / kind) for kind in KINDS}


def _llm(path: Path, **kw):
    from jaxserve import LLM

    return LLM(str(path), progress=False, enforce_eager=True, max_model_len=256, max_num_seqs=4,
               kv_cache_memory=1 << 20, compilation_cache_dir="", **{**EXACT, **kw})


def _generate(llm, prompts: list) -> list:
    from jaxserve.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    return llm.generate(prompts, params, use_tqdm=False)


def _check(outs: list, refs: list[tuple[list[int], list[int], list[float]]]) -> None:
    for out, (prompt_ids, tokens, _) in zip(outs, refs):
        assert list(out.prompt_token_ids) == prompt_ids  # placeholders expanded as the processor expands them
        assert list(out.outputs[0].token_ids) == tokens
    assert_logprobs_close([generated_logprobs(o.outputs[0]) for o in outs], [r[2] for r in refs])


@pytest.mark.parametrize("kind", KINDS)
def test_vision_tower_equals_transformers(checkpoints, kind):
    import jax
    import jax.numpy as jnp
    import torch
    import transformers

    from jaxserve.models.vision.attention import KEY_CHUNK
    from jaxserve.models.vision.qwen2_vl_vision import patch_layout, vision_forward
    from jaxserve.weights.loader import load_model

    path = checkpoints[kind]
    model = load_model(str(path), "float32", progress=False)
    vc = model.config.vision
    assert (vc.window_size, vc.fullatt_block_indexes) == ((56, (1,)) if kind == "qwen2_5_vl" else (0, ()))
    # BIG (26x30 patches, 780) spans the first 512-key chunk's end, its 13x15 blocks in partial windows too
    processor = transformers.AutoImageProcessor.from_pretrained(path, max_pixels=BIG.width * BIG.height)
    out = processor(images=IMAGES[:2] + [BIG, IMAGES[2]], return_tensors="np")
    grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"]]
    n = out["pixel_values"].shape[0]
    assert grids[2] == (1, 26, 30) and n == 892 and KEY_CHUNK < 64 + 780
    pixels = np.zeros((1024, vc.patch_dim), np.float32)  # padded: the rows past n see only each other
    pixels[:n] = out["pixel_values"]
    got = jax.jit(vision_forward, static_argnums=1)(model.params["vision"], vc, jnp.asarray(pixels),
                                                    *patch_layout(vc, grids, 1024))
    with torch.no_grad():
        want = hf_model(path).model.visual(torch.from_numpy(out["pixel_values"]),
                                           grid_thw=torch.from_numpy(out["image_grid_thw"])).pooler_output.numpy()
    np.testing.assert_allclose(np.asarray(got)[: n // vc.merge_unit], want, rtol=1e-5, atol=1e-5)


def test_rope_index_equals_transformers(checkpoints):
    import torch

    from jaxserve.multimodal.processor import processor_for
    from jaxserve.weights.loader import load_model

    path = checkpoints["qwen2_5_vl"]
    model = load_model(str(path), "float32", progress=False)
    ids, mm = processor_for(model, SimpleNamespace()).apply(
        {"prompt": TWO, "multi_modal_data": {"image": IMAGES[:2]}}, model.tokenizer.encode(TWO + " tail"))
    grids = torch.tensor([im.grid for im in mm.images])
    t = torch.tensor([ids])
    want, delta = hf_model(path).model.get_rope_index(t, (t == IDS["<|image_pad|>"]).int(), image_grid_thw=grids)
    np.testing.assert_array_equal(mm.positions, want[:, 0].numpy())
    assert mm.delta == int(delta) != 0
    # past the prompt (outputs, drafts): index + delta on all three axes, as transformers decodes
    np.testing.assert_array_equal(mm.positions_for(len(ids) - 2, 4)[:, 2:], np.full((3, 2), len(ids) + mm.delta)
                                  + np.arange(2))


def test_qwen2_5_vl_generate_equals_transformers(checkpoints):
    """Chunks of 32 tokens: the prompts' images are split across steps; IMAGES[1] twice: encoded once."""
    path = checkpoints["qwen2_5_vl"]
    prompts = [(ONE, [IMAGES[0]]), (TWO, [IMAGES[1], IMAGES[2]]), (TEXT, []), (ONE, [IMAGES[1]])]
    refs = [hf_generate(path, p, imgs, MAX_TOKENS) for p, imgs in prompts]
    with _llm(path, max_num_batched_tokens=32, enable_chunked_prefill=True) as llm:
        outs = _generate(llm, [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p
                               for p, imgs in prompts])
        _check(outs, refs)
        assert llm.llm_engine.runner.mm.num_images_encoded == 3
        # LLM.chat with a data: URL part: the fixture's template renders ONE around it
        from jaxserve.core.sampling_params import SamplingParams

        message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(IMAGES[0])}},
                                               {"type": "text", "text": "What is it?"}]}
        chat = llm.chat([message], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
        _check(chat, refs[:1])
        assert llm.llm_engine.runner.mm.num_images_encoded == 3  # the same pixels: the encoder cache's rows


def _data_url(im, fmt: str = "PNG") -> str:
    import base64
    import io

    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def test_qwen2_vl_generate_equals_transformers_with_prefix_cache(checkpoints):
    """The same text with two images of one size (the same tokens): the second prompt must not reuse the first's KV."""
    path = checkpoints["qwen2_vl"]
    refs = [hf_generate(path, ONE, [im], MAX_TOKENS) for im in (IMAGES[0], SAME_SIZE)]
    refs.append(hf_generate(path, TEXT, [], MAX_TOKENS))
    with _llm(path, max_num_batched_tokens=256, enable_prefix_caching=True) as llm:
        first = _generate(llm, [{"prompt": ONE, "multi_modal_data": {"image": IMAGES[0]}}, TEXT])
        again = _generate(llm, [{"prompt": ONE, "multi_modal_data": {"image": [SAME_SIZE]}}, TEXT])
        assert again[1].num_cached_tokens > 0  # the text-only prompt is served from the cache
        _check(first + again[:1], [refs[0], refs[2], refs[1]])
        llm.llm_engine.abort_request([])
        with pytest.raises(ValueError, match="prompt: 2 image placeholder"):  # two placeholders, one image
            _generate(llm, [{"prompt": TWO, "multi_modal_data": {"image": IMAGES[0]}}])
        with pytest.raises(ValueError, match="prompt: holds image placeholder"):
            _generate(llm, [ONE])
        with pytest.raises(ValueError, match="multi_modal_data: 'video'"):
            _generate(llm, [{"prompt": ONE, "multi_modal_data": {"video": [IMAGES[0]]}}])
        with pytest.raises(ValueError, match=r"multi_modal_data.image\[0\]"):
            _generate(llm, [{"prompt": ONE, "multi_modal_data": {"image": "a.png"}}])
        assert not llm.llm_engine.has_unfinished_requests()
        assert _async_tokens(llm, {"prompt": ONE, "multi_modal_data": {"image": IMAGES[0]}}) == refs[0][1]


def _async_tokens(llm, prompt: dict) -> list[int]:
    """The prompt through AsyncLLM (the server's engine front: the images processed by the caller)."""
    import asyncio

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.async_llm import AsyncLLM

    front = AsyncLLM(llm.llm_engine)

    async def run() -> list[int]:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)  # _generate's
        async for out in front.generate(prompt, params, "async-0"):
            final = out
        return list(final.outputs[0].token_ids)

    try:
        return asyncio.run(run())
    finally:
        front._stop.set()  # its thread only: the LLM shuts the engine down
        front._wake.set()
        front._thread.join(timeout=30)


def test_refusals():
    import base64

    from jaxserve.models import registry
    from jaxserve.multimodal.chat import chat_images
    from jaxserve.multimodal.processor import TextOnly

    png = base64.b64decode(_data_url(IMAGES[1]).split(",", 1)[1])
    for url, match in (("ftp://example.com/a.png", "unsupported URL scheme 'ftp'"),
                       ("file:///etc/passwd", "local files are read only when the server runs with"),
                       ("data:image/png;base64,@@@", "not valid base64"),
                       ("data:image/png;base64," + base64.b64encode(png[:len(png) // 2]).decode(), "not a readable")):
        message = {"role": "user", "content": [{"type": "text", "text": "x"},
                                               {"type": "image_url", "image_url": {"url": url}}]}
        with pytest.raises(ValueError, match=rf"^messages\[0\]\.content\[1\]\.image_url\.url: {match}"):
            chat_images([message])

    with pytest.raises(ValueError, match="multi_modal_data: LlamaForCausalLM takes text only"):
        TextOnly("LlamaForCausalLM").apply({"prompt": "x", "multi_modal_data": {"image": IMAGES[0]}}, [1])
    cfg = SimpleNamespace(architecture="Qwen2VLForConditionalGeneration")  # the engine's hook, before any weight
    for flag, value in (("pipeline_parallel_size", 2), ("enable_lora", True), ("quantization", "fp8")):
        with pytest.raises(ValueError, match=f"^{flag}: "):
            registry.refuse_flags(cfg, SimpleNamespace(**{flag: value}))
    registry.refuse_flags(cfg, SimpleNamespace(tensor_parallel_size=1, quantization=None))
    with pytest.raises(ValueError, match="^model: a awq checkpoint"):
        registry.refuse_flags(cfg, SimpleNamespace(), "awq")

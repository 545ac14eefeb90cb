"""`bench serve --dataset-name random-mm` and `bench throughput --dataset-name random-mm` (issue 52): vLLM's
flags and rules (jaxserve/bench/random_mm.py), then the real app over HTTP on the tiny Qwen2.5-VL of
tests/vl_fixtures.py: every request answered, each one's prompt tokens what transformers' own processor
and chat template make of the same text and JPEG images (so every image arrived and was expanded)."""

from __future__ import annotations

import argparse
import base64
import io
import math

import numpy as np
import pytest

from jaxserve.bench import random_mm, serve, throughput
from jaxserve.bench.datasets import WordTokenizer, build_requests, load_local_tokenizer

BUCKETS = "{(56, 56, 1): 0.5, (84, 112, 1): 0.5, (720, 1280, 16): 0.0}"


def _args(*argv: str, parser=serve.add_arguments) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    parser(p)
    return p.parse_args(["--dataset-name", "random-mm", *argv])


def _decode(part: dict):
    from PIL import Image

    url = part["image_url"]["url"]
    assert part["type"] == "image_url" and url.startswith("data:image/jpeg;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def test_flags_follow_vllms_rules():
    assert random_mm.parse_buckets("{(256, 256, 1): 1, (720, 1280, 1): 3, (720, 1280, 16): 0.0}") == \
        {(256, 256, 1): 0.25, (720, 1280, 1): 0.75}  # normalized, zero-probability (video) buckets dropped
    assert random_mm.items_range(2, 0.5, {"image": 255, "video": 1}) == (1, 3)  # [floor(n(1-r)), ceil(n(1+r))]
    assert random_mm.items_range(4, 1.0, {"image": 3, "video": 2}) == (0, 5)  # clamped to the limits' sum
    bad = [(lambda: random_mm.parse_buckets("{(720, 1280, 16): 0.2, (64, 64, 1): 1}"), "video is not supported"),
           (lambda: random_mm.parse_buckets("{(64, 64): 1}"), "(height, width, num_frames)"),
           (lambda: random_mm.parse_buckets("{(64, 64, 1): -1}"), "must be a number >= 0"),
           (lambda: random_mm.parse_buckets("not a dict"), "random_mm_bucket_config"),
           (lambda: random_mm.parse_limits('{"audio": 1}'), "unknown modality"),
           (lambda: random_mm.items_range(5, 0.0, {"image": 2, "video": 0}), "more than the 2"),
           (lambda: random_mm.items_range(1, 1.5, {"image": 2}), "random_mm_num_mm_items_range_ratio")]
    for call, message in bad:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            call()
    with pytest.raises(ValueError, match="use --endpoint /v1/chat/completions"):  # before any connection
        serve.run(_args("--base-url", "http://127.0.0.1:9", "--endpoint", "/v1/completions"))


def test_requests_are_seeded_and_drawn_from_the_flags():
    args = _args("--num-prompts", "40", "--random-input-len", "6", "--random-mm-base-items-per-request", "2",
                 "--random-mm-num-mm-items-range-ratio", "0.5", "--random-mm-limit-mm-per-prompt", '{"image": 2}',
                 "--random-mm-bucket-config", BUCKETS, "--seed", "3")
    reqs = build_requests(args, WordTokenizer(), as_ids=False)
    counts = [len(r.multi_modal_data) for r in reqs]
    assert set(counts) == {1, 2}  # [1, 3] drawn, capped at the image limit 2
    sizes = [_decode(p).size for r in reqs for p in r.multi_modal_data]
    assert set(sizes) == {(56, 56), (112, 84)}  # (width, height) of the (h, w) buckets
    again = build_requests(args, WordTokenizer(), as_ids=False)
    assert [r.multi_modal_data for r in again] == [r.multi_modal_data for r in reqs]
    assert [r.prompt for r in reqs] == [r.prompt for r in build_requests(
        _args("--num-prompts", "40", "--random-input-len", "6", "--seed", "3"), WordTokenizer(), as_ids=False)]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from jaxserve import LLM
    from tests.moe_fixtures import EXACT
    from tests.vl_fixtures import save_vl_checkpoint

    path = save_vl_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("vl") / "qwen2_5_vl")
    llm = LLM(str(path), progress=False, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64,
              kv_cache_memory=1 << 20, compilation_cache_dir="", enforce_eager=True, **EXACT)
    return path, llm


def _expected_prompt_tokens(path, req) -> int:
    """transformers' count: the chat template's ids, each image placeholder expanded by the processor."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    proc = transformers.AutoImageProcessor.from_pretrained(path)
    conv = [{"role": "user", "content": [{"type": "text", "text": req.prompt}, *req.multi_modal_data]}]
    ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False)
    images = [_decode(p).convert("RGB") for p in req.multi_modal_data]
    grids = proc(images=images, return_tensors="np")["image_grid_thw"] if images else []
    return len(ids) + sum(int(np.prod(g)) // 4 - 1 for g in grids)


def test_bench_serve_and_throughput_random_mm(vl):
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.openai.api_server import build_app
    from tests.fake_engine import serve_in_thread

    path, llm = vl
    # at most 2 images of at most 24 patches a request: one tower program (64 patches), few step shapes
    flags = ("--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "3", "--seed", "1",
             "--random-mm-base-items-per-request", "2", "--random-mm-num-mm-items-range-ratio", "0.5",
             "--random-mm-limit-mm-per-prompt", '{"image": 2}',
             "--random-mm-bucket-config", "{(56, 56, 1): 0.5, (84, 56, 1): 0.5}")
    # offline: bench throughput's path, LLM.generate on the chat prompts; bench serve sends the same requests
    # (seeded, the same tokenizer), so the offline run has compiled what the served one runs
    targs = _args(*flags, parser=throughput.add_arguments)
    reqs = build_requests(targs, load_local_tokenizer(str(path)), as_ids=True)
    assert sorted(len(r.multi_modal_data) for r in reqs) == [1, 2, 2]  # seed 1
    assert {_decode(p).size for r in reqs for p in r.multi_modal_data} == {(56, 56), (56, 84)}
    offline = throughput.run_throughput(llm, reqs, progress=False)
    expected = [_expected_prompt_tokens(path, r) for r in reqs]
    assert offline["total_input_tokens"] == sum(expected) and offline["total_output_tokens"] == 3 * 3
    engine = AsyncLLM(llm.llm_engine)
    try:
        with serve_in_thread(build_app(engine)) as url:
            res = serve.run(_args("--base-url", url, "--endpoint", "/v1/chat/completions", "--ignore-eos",
                                  "--tokenizer", str(path), "--disable-tqdm", *flags))
    finally:
        engine.shutdown()
    assert res["completed"] == 3 and res["failed"] == 0 and res["dataset_name"] == "random-mm"
    assert res["input_lens"] == expected
    assert res["output_lens"] == [3] * 3 and not math.isnan(res["output_throughput"])

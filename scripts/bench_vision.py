"""Vision-language serving on the CPU (issue 52): the vision tower's images/s, and bench serve's output tok/s
with random images (`--dataset-name random-mm`) beside the text-only rate, on one engine in one run.

    a Qwen2.5-VL of random weights saved by transformers (tiny but not trivial: a 4-block, 256-wide
      language model; a 4-block, 128-wide tower with windows and two full-attention blocks), the byte-level
      tokenizer and the real image processor of tests/vl_fixtures.py (max_pixels: 448 x 448)
    -> LLM (compiled, warmed up: the tower's patch buckets included)
    -> tower: the engine's own compiled tower (runner.mm) on batches of one image size, pixels from the
       engine's processor; images/s at each size, best of --repeats
    -> HTTP: the engine behind the real app (uvicorn, this process); `bench serve` with `random` text then
       `random-mm` (the same text lengths, --images images a request), /v1/chat/completions: a warm-up
       pass of each first, then --rounds measured passes interleaved, each side's best reported

    .venv/bin/python scripts/bench_vision.py --num-prompts 16 --max-concurrency 4
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TEXT = dict(vocab_size=272, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[8, 12, 12]))
VISION = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=256, window_size=112,
              fullatt_block_indexes=[1, 3], hidden_act="silu", patch_size=14, temporal_patch_size=2,
              spatial_merge_size=2, in_channels=3)
MAX_PIXELS = 448 * 448


def save_model(out: Path) -> Path:
    import torch
    import transformers

    from tests.vl_fixtures import IDS, TOKEN_IDS, save_tokenizer

    text = dict(TEXT, bos_token_id=IDS["<|endoftext|>"], eos_token_id=IDS["<|im_end|>"],
                pad_token_id=IDS["<|endoftext|>"])
    cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=VISION, **TOKEN_IDS)
    torch.manual_seed(0)
    transformers.Qwen2_5_VLForConditionalGeneration._from_config(cfg).float().save_pretrained(out)
    save_tokenizer(out)
    transformers.Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=MAX_PIXELS).save_pretrained(out)
    return out


def tower_rate(llm, size: int, repeats: int) -> tuple[float, int, int]:
    """(images/s, images a run, patches an image) of the engine's compiled tower on size x size images."""
    from tests.vl_fixtures import image

    engine = llm.llm_engine
    mm, params = engine.runner.mm, engine.runner.params["vision"]
    ids, inputs = engine.mm_processor.apply({"prompt": "", "multi_modal_data": {"image": image(size, size, 0)}},
                                            [engine.mm_processor.vision.image_token_id])
    item = inputs.images[0]
    per = item.pixel_values.shape[0]
    count = max(1, mm.buckets[-1] // per)  # as many as one run of the largest program takes
    grids, pixels = [item.grid] * count, [item.pixel_values] * count
    mm._run(params, grids, pixels)  # the bucket compiled at warm-up: this only warms caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mm._run(params, grids, pixels)
        best = min(best, time.perf_counter() - start)
    return count / best, count, per


@contextmanager
def serving(llm):
    import uvicorn

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.openai.api_server import build_app

    engine = AsyncLLM(llm.llm_engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()


def serve_rate(url: str, path: Path, dataset: str, a: argparse.Namespace, warm: bool) -> dict:
    from jaxserve.bench import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    argv = ["--base-url", url, "--endpoint", "/v1/chat/completions", "--tokenizer", str(path), "--ignore-eos",
            "--disable-tqdm", "--dataset-name", dataset, "--num-prompts", str(a.num_prompts),
            "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
            "--max-concurrency", str(a.max_concurrency), "--seed", "0",
            "--random-mm-base-items-per-request", str(a.images),
            "--random-mm-limit-mm-per-prompt", f'{{"image": {a.images}}}',
            "--random-mm-bucket-config", f"{{({a.image_size}, {a.image_size}, 1): 1.0}}"]
    if warm:
        serve.run(p.parse_args(argv))  # the same shapes once, so the measured passes compile nothing new
    res = serve.run(p.parse_args(argv))
    assert res["failed"] == 0, res["errors"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--images", type=int, default=1, help="images a random-mm request")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--tower-sizes", default="112,224,448")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="bench serve passes of each dataset, interleaved")
    a = ap.parse_args()
    from jaxserve import LLM

    path = save_model(Path(tempfile.mkdtemp()) / "qwen2_5_vl")
    start = time.perf_counter()
    llm = LLM(str(path), progress=False, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256,
              compilation_cache_dir="")
    print(f"engine ready in {time.perf_counter() - start:.0f} s (warm-up included); tower buckets "
          f"{llm.llm_engine.runner.mm.buckets}")
    for size in (int(s) for s in a.tower_sizes.split(",")):
        rate, count, per = tower_rate(llm, size, a.repeats)
        print(f"tower {size}x{size}: {per} patches ({per // 4} tokens) an image, {count} a run: {rate:.1f} images/s")
    best: dict[str, dict] = {}
    with serving(llm) as url:
        for round_ in range(a.rounds):  # interleaved, each side's best: a neighbour's burst decides neither
            for dataset in ("random", "random-mm"):
                res = serve_rate(url, path, dataset, a, warm=round_ == 0)
                print(f"  round {round_} {dataset}: {res['output_throughput']:.1f} output tok/s")
                if res["output_throughput"] > best.get(dataset, {}).get("output_throughput", -1):
                    best[dataset] = res
    for dataset, res in best.items():
        print(f"bench serve {dataset:9}: {res['output_throughput']:.1f} output tok/s, "
              f"{res['request_throughput']:.2f} req/s, mean TTFT {res['mean_ttft_ms']:.0f} ms, "
              f"input tokens {res['total_input_tokens']} ({a.num_prompts} prompts; best of {a.rounds})")


if __name__ == "__main__":
    main()

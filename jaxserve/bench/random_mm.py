"""The `random-mm` dataset (vLLM's name and flags): random text as the `random` dataset makes it, plus
random images attached to each request as base64 data URLs in chat content parts.

    --random-mm-base-items-per-request N       images a request carries (default 1) ...
    --random-mm-num-mm-items-range-ratio R     ... drawn uniformly from [floor(N(1-R)), ceil(N(1+R))],
                                               the maximum clamped to the sum of the limits below
    --random-mm-limit-mm-per-prompt JSON       per-modality caps (default {"image": 255, "video": 1})
    --random-mm-bucket-config DICT             {(height, width, num_frames): probability, ...}, a Python
                                               literal as vLLM takes it; normalized when the weights do
                                               not sum to 1. num_frames 1 is an image; a video bucket
                                               (num_frames > 1) with a probability above 0 is refused

Each image is uniform random RGB noise of its bucket's size (numpy, seeded by --seed), JPEG-encoded with
Pillow as vLLM's benchmark sends it. Video is not generated: jaxserve serves no video yet.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import math

import numpy as np

DEFAULT_LIMITS = '{"image": 255, "video": 1}'
DEFAULT_BUCKETS = "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}"
Bucket = tuple[int, int, int]


def add_args(g) -> None:
    """vLLM's random-mm flags, on the dataset argument group."""
    g.add_argument("--random-mm-base-items-per-request", type=int, default=1,
                   help="random-mm: images per request, before the range ratio (default 1)")
    g.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0,
                   help="random-mm: images per request uniform in [floor(n(1-r)), ceil(n(1+r))], r in [0, 1]")
    g.add_argument("--random-mm-limit-mm-per-prompt", default=DEFAULT_LIMITS, metavar="JSON",
                   help=f"random-mm: per-modality caps (default {DEFAULT_LIMITS})")
    g.add_argument("--random-mm-bucket-config", default=DEFAULT_BUCKETS, metavar="DICT",
                   help="random-mm: {(height, width, num_frames): probability} (num_frames 1: an image; "
                        f"video buckets must have probability 0); default {DEFAULT_BUCKETS}")


def parse_limits(value: str | dict) -> dict[str, int]:
    """The per-modality caps; ValueError naming the flag."""
    try:
        limits = json.loads(value) if isinstance(value, str) else dict(value)
    except ValueError:
        raise ValueError(f"random_mm_limit_mm_per_prompt: not JSON: {value!r}") from None
    if not isinstance(limits, dict):
        raise ValueError(f"random_mm_limit_mm_per_prompt: expected an object such as {DEFAULT_LIMITS}")
    for key, n in limits.items():
        if key not in ("image", "video"):
            raise ValueError(f"random_mm_limit_mm_per_prompt: unknown modality {key!r} (image, video)")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"random_mm_limit_mm_per_prompt: {key!r} must be an integer >= 0, got {n!r}")
    return limits


def parse_buckets(value: str | dict) -> dict[Bucket, float]:
    """The image buckets with their normalized probabilities (zero ones dropped); ValueError naming the
    flag for a malformed one, and for a video bucket that could be drawn."""
    flag = "random_mm_bucket_config"
    try:
        raw = ast.literal_eval(value) if isinstance(value, str) else dict(value)
    except (ValueError, SyntaxError):
        raise ValueError(f"{flag}: not a Python dict literal such as {DEFAULT_BUCKETS}: {value!r}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{flag}: expected a non-empty dict such as {DEFAULT_BUCKETS}")
    buckets: dict[Bucket, float] = {}
    for key, p in raw.items():
        if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(v, int) and v >= 1 for v in key)):
            raise ValueError(f"{flag}: a key must be (height, width, num_frames), positive integers; got {key!r}")
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not p >= 0:
            raise ValueError(f"{flag}: the probability of {key} must be a number >= 0, got {p!r}")
        if key[2] > 1 and p > 0:
            raise ValueError(f"{flag}: {key} is a video bucket (num_frames {key[2]}); video is not supported yet: "
                             "give video buckets probability 0")
        if p > 0:
            buckets[key] = float(p)
    if not buckets:
        raise ValueError(f"{flag}: no image bucket has a probability above 0")
    total = sum(buckets.values())
    return {k: p / total for k, p in buckets.items()}


def items_range(base: int, ratio: float, limits: dict[str, int]) -> tuple[int, int]:
    """The closed range images-per-request is drawn from (vLLM's rule)."""
    if base < 0:
        raise ValueError(f"random_mm_base_items_per_request: must be >= 0, got {base}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"random_mm_num_mm_items_range_ratio: must be in [0, 1], got {ratio}")
    lo, hi = math.floor(base * (1 - ratio)), math.ceil(base * (1 + ratio))
    hi = min(hi, sum(limits.values()))
    if lo > hi:
        raise ValueError(f"random_mm_base_items_per_request: at least {lo} items a request, more than the "
                         f"{hi} --random-mm-limit-mm-per-prompt allows")
    return lo, hi


def image_part(rng: np.random.Generator, height: int, width: int) -> dict:
    """A chat content part: random RGB noise, JPEG-encoded, as a data URL."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def check_args(args) -> tuple[dict[str, int], dict[Bucket, float], tuple[int, int]]:
    """(limits, buckets, the items' range) of the random-mm flags; ValueError naming a bad one, before any
    model is loaded or request sent."""
    limits = parse_limits(args.random_mm_limit_mm_per_prompt)
    buckets = parse_buckets(args.random_mm_bucket_config)
    return limits, buckets, items_range(args.random_mm_base_items_per_request,
                                        args.random_mm_num_mm_items_range_ratio, limits)


def add_images(requests: list, args) -> list:
    """The `random` dataset's requests (bench/datasets.py's SampleRequest), each given its images
    (SampleRequest.multi_modal_data) as the random-mm flags draw them."""
    limits, buckets, (lo, hi) = check_args(args)
    cap = limits.get("image", 0)  # the only modality drawn: past its cap, nothing is left to draw (vLLM)
    rng = np.random.default_rng(args.seed + 1)  # not the text's stream: the same prompts as `random`
    keys, probs = list(buckets), np.asarray(list(buckets.values()))
    for req in requests:
        count = min(int(rng.integers(lo, hi + 1)), cap)
        sizes = [keys[i] for i in rng.choice(len(keys), size=count, p=probs)]
        req.multi_modal_data = [image_part(rng, h, w) for h, w, _ in sizes]
    return requests


def engine_prompts(llm, requests: list) -> list[dict]:
    """`bench throughput`: each request as LLM.chat builds it (its images decoded from the data URLs by
    the engine's media loader, the chat template applied), for LLM.generate."""
    from jaxserve.multimodal.chat import chat_images

    tok, mm = llm.llm_engine.tokenizer, getattr(llm.llm_engine, "mm_processor", None)
    prompts = []
    for req in requests:
        conv = [{"role": "user", "content": [{"type": "text", "text": req.prompt}, *(req.multi_modal_data or [])]}]
        conv, images = chat_images(conv, getattr(mm, "media", None), getattr(mm, "limit", None))
        ids = list(tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False))
        prompts.append({"prompt_token_ids": ids, **({"multi_modal_data": {"image": images}} if images else {})})
    return prompts

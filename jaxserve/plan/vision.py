"""`jaxserve plan` for a vision-language model (Qwen2-VL, Qwen2.5-VL): what the vision side costs, from
config.json's vision_config (models/vision/config.py) and, when the model is a local directory, its
preprocessor_config.json (max_pixels), sized as the engine sizes it (jaxserve/multimodal/runner.py).

    tower weights     every parameter of transformers' tower: the patch embedding (a Conv3d without bias),
                      `depth` blocks (two norms, qkv, proj, the MLP: fc1/fc2 or gate/up/down, all with
                      biases), the merger (norm, Linear 4D -> 4D, Linear 4D -> out); in the model dtype,
                      whole on every device (the engine does not shard the tower)
    tower activation  the largest program warm-up compiles: patches = the first power of two >= the
                      encoder budget (max_num_batched_tokens x merge_unit, raised to the processor's
                      largest image); its attention is linear in N (models/vision/attention.py): the
                      full blocks' [heads, N, KEY_CHUNK] float32 scores and exponents, or the window
                      blocks' [heads, N, 3 x window chunk] ones, beside the block's row tensors. The
                      tower and the language model run as separate programs, so the step's reserve is
                      the larger of the two
    encoder cache     host memory, not the device's: the runner keeps each image's merged rows in numpy
                      up to DEFAULT_CACHE_BYTES (least recently used dropped beyond it); listed with the
                      image tokens it holds, never taken from the KV budget
    processor cache   host memory too: --mm-processor-cache-gb GiB of processed patches (vLLM's 4 by default)

--mm-processor-kwargs' max_pixels (or size.longest_edge) stands over the checkpoint's, as the engine's.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxserve.models.vision.attention import KEY_CHUNK, key_chunk, window_chunk
from jaxserve.models.vision.config import VisionConfig
from jaxserve.multimodal.runner import DEFAULT_CACHE_BYTES, MIN_PATCH_BUCKET


def vision_params(vc: VisionConfig) -> int:
    """The tower's parameter count: transformers' `model.visual` numel (tests/test_plan_vision.py)."""
    d, inter, merged = vc.hidden_size, vc.intermediate_size, vc.merge_unit * vc.hidden_size
    norm = 2 * d if vc.kind == "qwen2_vl" else d  # LayerNorm: weight and bias; RMSNorm: weight
    if vc.kind == "qwen2_vl":
        mlp = 2 * d * inter + inter + d  # fc1 [D, I] + bias, fc2 [I, D] + bias
    else:
        mlp = 3 * d * inter + 2 * inter + d  # gate, up [D, I] + biases, down [I, D] + bias
    block = 2 * norm + (d * 3 * d + 3 * d) + (d * d + d) + mlp
    merger = norm + (merged * merged + merged) + (merged * vc.out_hidden_size + vc.out_hidden_size)
    return d * vc.patch_dim + vc.depth * block + merger


def max_image_patches(model_dir: Path | None, vc: VisionConfig, overrides: dict | None = None) -> int | None:
    """The patches of the largest image the checkpoint's processor makes (its max_pixels, as
    multimodal/processor.py reads them, `overrides` (--mm-processor-kwargs) over the file's); None when
    neither says."""
    path = model_dir / "preprocessor_config.json" if model_dir is not None and model_dir.is_dir() else None
    d = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    d.update(overrides or {})
    size = d.get("size") if isinstance(d.get("size"), dict) else {}
    pixels = d.get("max_pixels") or size.get("longest_edge")
    return None if pixels is None else int(pixels) // vc.patch_size ** 2


def patch_bucket(vc: VisionConfig, max_num_batched_tokens: int, largest_image: int | None) -> tuple[int, int]:
    """(the encoder budget in patches, the largest tower program's patch count), as the runner's
    `patch_budget` after ImageProcessor.bind and its `buckets[-1]`."""
    budget = max(max_num_batched_tokens * vc.merge_unit, largest_image or 0)
    bucket = MIN_PATCH_BUCKET
    while bucket < budget:
        bucket *= 2
    return budget, bucket


def tower_activation_bytes(vc: VisionConfig, patches: int, width: int) -> int:
    """One tower program's temporaries at `patches` rows (XLA's measurement: tests/test_plan_vision.py):
    the residual and the block's output, then the larger of the attention's and the MLP's moment. The
    attention holds qkv and the rotated q, k, its running output (float32) and its scores and exponents
    (float32): a full block's over one key chunk, a window block's over three window chunks (beside the
    banded keys and values)."""
    d, n, heads = vc.hidden_size, patches, vc.num_heads
    full = heads * n * key_chunk(n) * 8 + n * d * 4 * 2
    attention = full
    if vc.window_size and n > KEY_CHUNK:  # at most KEY_CHUNK patches: one dense masked softmax for both kinds
        attention = max(full, heads * n * 3 * window_chunk(vc, n) * 8 + 6 * n * d * width)
    attention += n * 3 * d * width * 2
    mlp = n * 3 * vc.intermediate_size * width
    return n * d * width * 2 + max(attention, mlp)


def vision_figures(vc: VisionConfig, width: int, max_num_batched_tokens: int, largest_image: int | None,
                   processor_cache_bytes: int = 4 << 30, cache_bytes: int = DEFAULT_CACHE_BYTES) -> dict:
    """The --json fields of the vision side (see the module docstring)."""
    params = vision_params(vc)
    budget, bucket = patch_bucket(vc, max_num_batched_tokens, largest_image)
    return dict(vision_params=params, vision_weights_bytes=params * width, vision_patch_budget=budget,
                vision_max_image_patches=largest_image, vision_largest_program_patches=bucket,
                vision_activation_bytes=tower_activation_bytes(vc, bucket, width),
                encoder_cache_bytes=cache_bytes,
                encoder_cache_image_tokens=cache_bytes // (vc.out_hidden_size * width),
                processor_cache_bytes=processor_cache_bytes)


def render_lines(r: dict) -> list[str]:
    """The text output's vision lines (empty for a text-only model)."""
    if r.get("vision_params") is None:
        return []
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    source = (f"the processor's largest image, {r['vision_max_image_patches']} patches"
              if r["vision_max_image_patches"] and r["vision_max_image_patches"] >= r["vision_patch_budget"]
              else "max_num_batched_tokens merged rows")
    return [f"  vision tower        {gb(r['vision_weights_bytes'])}  ({r['vision_params'] / 1e6:.1f} M params, "
            f"whole on each device)",
            f"  vision activation   {gb(r['vision_activation_bytes'])}  (its largest program: "
            f"{r['vision_largest_program_patches']} patches, attention in chunks; budget {r['vision_patch_budget']} "
            f"patches from {source})",
            f"  encoder cache       {gb(r['encoder_cache_bytes'])}  (host memory, not the device's: "
            f"{r['encoder_cache_image_tokens']} image tokens)",
            f"  processor cache     {gb(r['processor_cache_bytes'])}  (host memory: --mm-processor-cache-gb)"]

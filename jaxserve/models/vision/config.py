"""A vision-language model's vision side, read from config.json: its tower (the `vision_config`) and
what the language model needs of it (the image placeholder token, M-RoPE's sections). Pure Python:
ModelConfig holds one (`ModelConfig.vision`), and ModelConfig is a static argument of the jitted step.

    kind          tower                                         blocks
    qwen2_vl      Qwen2-VL's: LayerNorm, fc1 -> act -> fc2         full attention over each image
    qwen2_5_vl    Qwen2.5-VL's: RMSNorm, SwiGLU (gate/up/down)     windows of `window_size` pixels, full
                                                                   attention in fullatt_block_indexes
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

KINDS = ("qwen2_vl", "qwen2_5_vl")
# transformers' ACT2FN names the towers use
ACTIVATIONS = ("silu", "quick_gelu", "gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class VisionConfig:
    kind: str  # one of KINDS
    depth: int
    hidden_size: int  # the tower's width (Qwen2-VL's embed_dim)
    num_heads: int
    intermediate_size: int  # the block MLP's width
    hidden_act: str
    out_hidden_size: int  # the patch merger's output: the language model's width
    image_token_id: int  # the placeholder token an image's rows replace (<|image_pad|>)
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    window_size: int = 0  # Qwen2.5-VL: the attention window in pixels; 0: full attention in every block
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    # M-RoPE: how many of the language model's rotary frequencies follow time, height, width
    mrope_section: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"vision_config: kind must be one of {KINDS}, got {self.kind!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act: {self.hidden_act!r} is not supported; "
                             f"supported: {', '.join(ACTIVATIONS)}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision_config: hidden_size {self.hidden_size} over {self.num_heads} heads must give a "
                             "head_dim divisible by 4 (its 2-D rotary halves)")
        if len(self.mrope_section) != 3:
            raise ValueError(f"rope_parameters.mrope_section must name 3 sections, got {self.mrope_section}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches merged into one language-model token (2x2)."""
        return self.spatial_merge_size ** 2

    @property
    def patch_dim(self) -> int:
        """One flattened patch as the processor gives it: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_dict(cls, d: Mapping) -> "VisionConfig":
        d = dict(d)
        d["fullatt_block_indexes"] = tuple(d.get("fullatt_block_indexes") or ())
        d["mrope_section"] = tuple(d.get("mrope_section") or ())
        return cls(**d)


def vision_from_hf(hf: Mapping, kind: str) -> VisionConfig:
    """config.json (the whole file: transformers >= 5 nests the language model in text_config, older
    files keep it at the top) -> the VisionConfig of a `kind` model; ValueError naming a missing field."""
    vc = hf.get("vision_config")
    if not isinstance(vc, Mapping):
        raise ValueError("config.json: a vision-language model needs a vision_config object")
    text = hf.get("text_config") if isinstance(hf.get("text_config"), Mapping) else hf
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or hf.get("rope_scaling") or {})
    section = rope.get("mrope_section")
    if not section:
        raise ValueError("config.json: rope_parameters.mrope_section is missing (M-RoPE's time/height/width split)")
    try:
        if kind == "qwen2_vl":  # embed_dim is the tower, hidden_size the merger's output
            width, out = int(vc["embed_dim"]), int(vc["hidden_size"])
            inter = int(width * float(vc.get("mlp_ratio", 4)))
        else:
            width, out, inter = int(vc["hidden_size"]), int(vc["out_hidden_size"]), int(vc["intermediate_size"])
        vrope = vc.get("rope_parameters") or {}
        return VisionConfig(
            kind=kind, depth=int(vc["depth"]), hidden_size=width, num_heads=int(vc["num_heads"]),
            intermediate_size=inter,
            hidden_act=str(vc.get("hidden_act", "quick_gelu" if kind == "qwen2_vl" else "silu")),
            out_hidden_size=out, image_token_id=int(hf["image_token_id"]),
            video_token_id=hf.get("video_token_id"), vision_start_token_id=hf.get("vision_start_token_id"),
            patch_size=int(vc.get("patch_size", 14)), temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
            in_channels=int(vc.get("in_channels", vc.get("in_chans", 3))),
            spatial_merge_size=int(vc.get("spatial_merge_size", 2)),
            window_size=int(vc.get("window_size", 0)) if kind == "qwen2_5_vl" else 0,
            fullatt_block_indexes=tuple(int(i) for i in vc.get("fullatt_block_indexes") or ()),
            rope_theta=float(vrope.get("rope_theta", 10000.0)), mrope_section=tuple(int(s) for s in section))
    except KeyError as e:
        raise ValueError(f"config.json: missing required field {e.args[0]!r} of the vision model") from None

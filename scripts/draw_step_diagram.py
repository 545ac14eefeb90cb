"""Draw docs/images/step.png: one engine step (schedule -> execute -> update -> outputs) and its layers.

    .venv/bin/python scripts/draw_step_diagram.py [--out docs/images/step.png]

The picture is the ASCII sketch of docs/architecture.md ("The step") drawn with matplotlib;
change both together.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

# (label, detail, layer folder, colour): the boxes top to bottom
STAGES = [
    ("scheduler.schedule()", "which requests run, how many tokens each,\ntheir block tables and sampling inputs",
     "jaxserve/core\n(pure Python, no JAX)", "#dbe9f6"),
    ("runner.execute(out)", "pack the ragged batch into a token bucket;\njitted model step (K/V into the paged pool,"
     "\nattention) and the on-device sampler", "jaxserve/worker\n+ models, sample, pallas_kernels", "#fde6cf"),
    ("scheduler.update(out, model_out)", "accepted tokens (drafts up to the first\nrejected one), finish reasons;"
     "\nfinished requests free their blocks", "jaxserve/core", "#dbe9f6"),
    ("output processor", "incremental detokenizing, stop strings,\nn > 1 and beams",
     "jaxserve/engine", "#e2f0d9"),
]
# what crosses between consecutive boxes
EDGES = ["SchedulerOutput\n(plain ints, lists, numpy)", "ModelOutput\n(sampled ids, logprobs)",
         "RequestUpdate per request"]


def draw(out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8.2, 6.4))
    ax.set_xlim(-0.7, 10)
    ax.set_ylim(0, 10.6)
    ax.axis("off")
    box_h, gap, top = 1.65, 0.8, 10.2
    ys = [top - box_h - i * (box_h + gap) for i in range(len(STAGES))]
    for (label, detail, layer, colour), y in zip(STAGES, ys):
        ax.add_patch(FancyBboxPatch((0.2, y), 6.3, box_h, boxstyle="round,pad=0.05", fc=colour, ec="#444"))
        ax.text(0.4, y + box_h - 0.25, label, fontsize=11, fontweight="bold", family="monospace", va="center")
        ax.text(0.4, y + box_h - 0.55, detail, fontsize=8.5, va="top")
        ax.text(6.8, y + box_h / 2, layer, fontsize=8.5, va="center", style="italic", color="#333")
    for i, edge in enumerate(EDGES):
        y0, y1 = ys[i], ys[i + 1] + box_h
        ax.add_patch(FancyArrowPatch((3.35, y0 - 0.04), (3.35, y1 + 0.06), arrowstyle="-|>", mutation_scale=14,
                                     color="#222"))
        ax.text(3.55, (y0 + y1) / 2, edge, fontsize=8, va="center", color="#1f4e79")
    ax.add_patch(FancyArrowPatch((3.35, ys[-1] - 0.04), (3.35, 0.05), arrowstyle="-|>", mutation_scale=14,
                                 color="#222"))
    ax.text(3.55, ys[-1] / 2, "RequestOutput per request -> LLM.generate() / the OpenAI server", fontsize=8,
            va="center", color="#1f4e79")
    # the loop: LLMEngine.step() runs the four boxes once; AsyncLLM calls it again
    ax.add_patch(FancyArrowPatch((0.15, ys[-1] + box_h / 2), (0.15, ys[0] + box_h / 2),
                                 connectionstyle="arc3,rad=-0.3", arrowstyle="-|>", mutation_scale=12, color="#888",
                                 linestyle="--"))
    ax.text(-0.55, (ys[-1] + ys[0] + box_h) / 2, "next step", fontsize=8, rotation=90, va="center", color="#666")
    ax.text(0.02, 10.45, "LLMEngine.step(): one iteration (AsyncLLM loops it on its own thread)", fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "images" / "step.png"))
    print(draw(Path(p.parse_args().out)))


if __name__ == "__main__":
    main()

"""examples/grpo.py cannot rot: two GRPO steps on a tiny random Llama through the example's own
train(), the engine's sampled logprobs equal to the trainer's forward of the params it holds
(float32, the exact flags; at step 2 the updated ones, so the update landed), and
examples/grpo.ipynb holding the same cells as the script."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXACT = dict(dtype="float32", kv_cache_dtype="auto", block_size=16, speculative_config={})


def _example():
    spec = importlib.util.spec_from_file_location("grpo_example", EXAMPLES / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAST_CELL = 'history = main(["--steps", "20"])'


def _cells(source: str) -> list[tuple[str, str]]:
    """The script's percent-format cells: ("markdown" | "code", text), markdown without its "# "."""
    cells: list[tuple[str, list[str]]] = []
    for line in source.splitlines():
        if line.startswith("# %%"):
            cells.append(("markdown" if "[markdown]" in line else "code", []))
        elif cells:
            cells[-1][1].append(line[2:] if cells[-1][0] == "markdown" else line)
    return [(kind, "\n".join(lines).strip("\n")) for kind, lines in cells]


def write_notebook() -> None:
    """examples/grpo.ipynb from examples/grpo.py's cells, plus a last cell that runs it."""
    import nbformat

    cells = [nbformat.v4.new_markdown_cell(text) if kind == "markdown" else nbformat.v4.new_code_cell(text)
             for kind, text in _cells((EXAMPLES / "grpo.py").read_text()) if "__main__" not in text]
    nb = nbformat.v4.new_notebook(cells=cells + [nbformat.v4.new_code_cell(LAST_CELL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, EXAMPLES / "grpo.ipynb")


def test_two_grpo_steps_on_a_tiny_model(tiny_llama_dir):
    from jaxserve import LLM

    grpo = _example()
    # a random model's completions: a reward that differs between any two of them, so every group has
    # a non-zero advantage and the step moves the weights (the example's colour check is its own)
    grpo.reward = lambda text, words: (sum(map(ord, text)) % 7) / 7
    llm = LLM(str(tiny_llama_dir), **EXACT, max_model_len=64, max_num_seqs=4, enforce_eager=True, progress=False)
    try:
        before = np.asarray(llm.engine_params()["layers"]["wq"]).copy()
        logs: list[str] = []
        history = grpo.train(llm, steps=2, subjects=["the sky", "a car"], n=2, max_tokens=4,
                             lr=1e-2, log=logs.append)
        assert [row["step"] for row in history] == [1, 2] and len(logs) == 2
        for row in history:
            assert all(np.isfinite(v) for v in row.values())
            assert row["rollout_tok_s"] > 0 and row["sync_s"] >= 0
            # the engine's sampled logprobs equal the trainer's forward of the params it holds; at step 2
            # those are step 1's update (lr 1e-2 moves them far past 1e-4): the update landed in the engine
            assert row["mismatch"] < 1e-4, row
        assert not np.array_equal(np.asarray(llm.engine_params()["layers"]["wq"]), before)
    finally:
        llm.shutdown()


def test_notebook_holds_the_script_cells():
    """Regenerate after editing the script: `.venv/bin/python tests/test_grpo_example.py`."""
    notebook = json.loads((EXAMPLES / "grpo.ipynb").read_text())
    got = [(c["cell_type"], "".join(c["source"])) for c in notebook["cells"]]
    want = [c for c in _cells((EXAMPLES / "grpo.py").read_text()) if "__main__" not in c[1]]
    assert got == want + [("code", LAST_CELL)]


if __name__ == "__main__":
    write_notebook()

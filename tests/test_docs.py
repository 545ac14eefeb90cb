"""The docs stay true: every serve flag is documented, the README's Python example runs, every page is
reachable from the README and every relative link resolves.

Checks whatever is in docs/ now, so pages added later are held to the same rules.
"""

from __future__ import annotations

import argparse
import re
from collections import deque
from pathlib import Path

import pytest

from tests.conftest import ENGINE

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _serve_parser() -> argparse.ArgumentParser:
    """`jaxserve serve`'s parser, built by the console script's own code (no subprocess)."""
    from jaxserve.cli import build_parser

    top = build_parser("serve")
    (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]


def _without_code_blocks(text: str) -> str:
    return FENCE.sub("", text)


def _relative_links(md: Path) -> list[str]:
    """Link targets in a Markdown file (outside fenced code), minus web links and in-page anchors."""
    text = re.sub(r"`[^`\n]*`", "", _without_code_blocks(md.read_text(encoding="utf-8")))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_every_serve_flag_is_in_serving_md():
    help_text = _serve_parser().format_help()
    flags = sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", help_text)))
    assert "--max-num-seqs" in flags and "--no-enable-chunked-prefill" in flags  # the parser is the real one
    doc = (DOCS / "serving.md").read_text(encoding="utf-8")
    missing = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", doc)]
    assert not missing, f"docs/serving.md does not name these `jaxserve serve` flags: {missing}"


def test_readme_python_example_runs(jax_default_model, monkeypatch, capsys):
    """The README's `LLM` block, exec'd as written. `LLM` is the real class on the default model;
    the shared small bucket grid of the suite (conftest's ENGINE) keeps the warm-up to seconds."""
    import jaxserve
    from jaxserve.entrypoints.llm import LLM

    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
    (code,) = [b for b in blocks if "from jaxserve import LLM" in b]

    def small_llm(model=None, **kwargs):
        assert model is None, "the README's example uses the default model"
        return LLM(jax_default_model, progress=False, **{**ENGINE, **kwargs})

    monkeypatch.setattr(jaxserve, "LLM", small_llm, raising=False)  # `from jaxserve import LLM` finds it
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert any(ln.endswith((" length", " stop")) for ln in lines), lines  # text + finish_reason printed
    assert len(lines) >= 3, lines


def test_every_docs_page_is_reachable_from_readme():
    seen, queue = {README.resolve()}, deque([README])
    while queue:
        page = queue.popleft()
        for target in _relative_links(page):
            path = (page.parent / target.split("#")[0]).resolve()
            if path.suffix == ".md" and path.is_file() and path not in seen:
                seen.add(path)
                queue.append(path)
    unreachable = [str(p.relative_to(ROOT)) for p in _pages() if p.resolve() not in seen]
    assert not unreachable, f"not linked from README.md (directly or through a page it links): {unreachable}"


@pytest.mark.parametrize("md", [README, ROOT / "BENCHMARKS.md", *_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md):
    broken = [t for t in _relative_links(md) if not (md.parent / t.split("#")[0]).exists()]
    assert not broken, f"{md.relative_to(ROOT)}: links to missing files: {broken}"

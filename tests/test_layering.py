"""Imports run one way: a module never imports one of a higher layer, and jaxserve/ has no import cycle.

Every module under jaxserve/ and pallas_kernels/ is parsed with `ast` (no import runs), and every
import counts: at module level, inside functions, under `if TYPE_CHECKING:`, and
`importlib.import_module("literal")`. `from a.b import c` is an edge to the module a.b.c when
that is a module, else to a.b. The layers are docs/architecture.md's table ("The folders and who
may import whom"), read from the page: a new package is given its row there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_PACKAGES = ("jaxserve", "pallas_kernels")

ARCHITECTURE = ROOT / "docs" / "architecture.md"
TABLE_HEADING = "## The folders and who may import whom"


def parse_layers(markdown: str) -> tuple[list[tuple[str, tuple[str, ...]]], set[str]]:
    """docs/architecture.md's layer table, the one source of the rule: (layer, module names) lowest
    first, and the names that match only themselves. A folder `a/b/` is the module a.b and
    everything under it, a file `a/b.py` the module a.b, `a/__init__.py` the package a alone."""
    section = markdown.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    if len(rows) < 3 or [c.strip() for c in rows[0].strip("|").split("|")][:2] != ["layer", "folders"]:
        raise ValueError(f"no | layer | folders | ... | table under {TABLE_HEADING!r} in docs/architecture.md")
    layers, exact_only = [], set()
    for row in rows[2:]:  # past the header and its |---| line
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = []
        for path in re.findall(r"`([^`]+)`", cells[1]):
            if not re.fullmatch(r"[a-z_]+(/[a-z_]+)*(/|\.py)", path):
                raise ValueError(f"layer {cells[0]!r}: {path!r} is neither a folder (a/b/) nor a file (a/b.py)")
            name = path.removesuffix("/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            if path.endswith("/__init__.py"):
                exact_only.add(name)
            names.append(name)
        if not names:
            raise ValueError(f"layer {cells[0]!r} names no folder")
        layers.append((cells[0], tuple(names)))
    return layers, exact_only


# Lowest first. A module may import its own layer and those below it, never one above. A name
# matches itself and everything under it (EXACT_ONLY: itself alone); the longest match wins.
LAYERS, EXACT_ONLY = parse_layers(ARCHITECTURE.read_text(encoding="utf-8"))


def module_files(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for top in TOP_PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_names(module: str, source: str, is_package: bool) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in `source`, relative ones resolved; `from a import b`
    gives a.b (the caller falls back to a when a.b is not a module)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.args[0].value, node.lineno))
    return out


def import_graph(modules: dict[str, str], packages: set[str]) -> dict[str, dict[str, int]]:
    """module -> {imported project module: first line}, from each module's source."""
    graph: dict[str, dict[str, int]] = {}
    for module, source in modules.items():
        edges: dict[str, int] = {}
        for name, line in imported_names(module, source, module in packages):
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in modules and name != module:
                edges.setdefault(name, line)
        graph[module] = edges
    return graph


def layer_of(module: str) -> int | None:
    best, best_len = None, -1
    for rank, (_, names) in enumerate(LAYERS):
        for name in names:
            exact = module == name
            under = module.startswith(name + ".") and name not in EXACT_ONLY
            if (exact or under) and len(name) > best_len:
                best, best_len = rank, len(name)
    return best


def layer_violations(graph: dict[str, dict[str, int]], files: dict[str, Path] | None = None) -> list[str]:
    out = []
    for module, edges in sorted(graph.items()):
        low = layer_of(module)
        if low is None:
            continue
        for target, line in sorted(edges.items()):
            high = layer_of(target)
            if high is not None and high > low:
                where = f"{files[module].relative_to(ROOT)}:{line}" if files else f"{module}:{line}"
                out.append(f"{where}: {module} ({LAYERS[low][0]}) imports {target} ({LAYERS[high][0]})")
    return out


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def project():
    files = module_files()
    sources = {m: p.read_text() for m, p in files.items()}
    packages = {m for m, p in files.items() if p.name == "__init__.py"}
    return files, import_graph(sources, packages)


def test_every_module_has_a_layer(project):
    files, _ = project
    missing = sorted(m for m in files if layer_of(m) is None)
    assert not missing, (f"modules in no layer: {missing}. Add their package to docs/architecture.md's "
                         "layer table (\"The folders and who may import whom\") at its place")


def test_every_layer_entry_names_a_module(project):
    files, _ = project
    stale = [n for _, names in LAYERS for n in names if n not in files]
    assert not stale, f"docs/architecture.md's layer table names modules that do not exist: {stale}"


def test_no_lower_layer_imports_a_higher_one(project):
    files, graph = project
    bad = layer_violations(graph, files)
    assert not bad, "imports that run upwards (pass plain values down, or move the code):\n" + "\n".join(bad)


def test_no_import_cycles(project):
    _, graph = project
    found = cycles({m: e for m, e in graph.items() if m.startswith("jaxserve")})
    detail = ["  " + " <-> ".join(c) + "\n" + "\n".join(f"    {a} -> {b} (line {graph[a][b]})"
                                                        for a in c for b in graph[a] if b in c) for c in found]
    assert not found, "import cycles among jaxserve/ modules:\n" + "\n".join(detail)


def test_the_checks_catch_what_they_are_for():
    """The checker itself, on a made-up tree: an upward import inside a function, and a cycle
    made of a TYPE_CHECKING import and a relative one."""
    sources = {
        "jaxserve.core": "",
        "jaxserve.core.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxserve.core.b import X\n",
        "jaxserve.core.b": "from . import a\n",
        "jaxserve.worker": "",
        "jaxserve.worker.w": "def f():\n    from jaxserve.engine import llm_engine\n",
        "jaxserve.engine": "",
        "jaxserve.engine.llm_engine": "import jaxserve.worker.w\n",
        "jaxserve.newpkg": "",
    }
    graph = import_graph(sources, {"jaxserve.core", "jaxserve.worker", "jaxserve.engine", "jaxserve.newpkg"})
    assert graph["jaxserve.core.b"] == {"jaxserve.core.a": 1}
    worker, engine = LAYERS[layer_of("jaxserve.worker.w")][0], LAYERS[layer_of("jaxserve.engine.llm_engine")][0]
    assert layer_violations(graph) == [f"jaxserve.worker.w:2: jaxserve.worker.w ({worker}) imports "
                                       f"jaxserve.engine.llm_engine ({engine})"]
    assert sorted(cycles(graph)) == [["jaxserve.core.a", "jaxserve.core.b"],
                                     ["jaxserve.engine.llm_engine", "jaxserve.worker.w"]]
    assert layer_of("jaxserve.newpkg") is None and layer_of("jaxserve.newpkg.slots") is None
    assert layer_of("jaxserve") == len(LAYERS) - 1 and layer_of("jaxserve.cli") == len(LAYERS) - 1
    assert layer_of("jaxserve.quantization.quantize") > layer_of("jaxserve.models.llama") \
        > layer_of("jaxserve.quantization.matmul")


def test_the_layer_table_is_read_as_written():
    """The parser on a made-up page: folders match everything under them, files themselves, an
    __init__.py its package alone; a cell that is not a path, or a missing table, is an error."""
    page = (f"# x\n\n{TABLE_HEADING}\n\ntext\n\n| layer | folders | what |\n|---|---|---|\n"
            "| low | `pkg/core/`, `pkg/constants.py` | a |\n| top | `pkg/cli.py`, `pkg/__init__.py` | b |\n\n"
            "## Next\n\n| layer | folders | what |\n|---|---|---|\n| ignored | `other/` | c |\n")
    assert parse_layers(page) == ([("low", ("pkg.core", "pkg.constants")), ("top", ("pkg.cli", "pkg"))], {"pkg"})
    with pytest.raises(ValueError, match="neither a folder"):
        parse_layers(page.replace("`pkg/cli.py`", "`LLMEngine`"))
    with pytest.raises(ValueError, match="no | layer | folders"):
        parse_layers(page.replace("| layer | folders | what |", "| kind | where | what |", 1))
    assert LAYERS[0][1] == ("jaxserve.constants", "jaxserve.core") and "jaxserve.entrypoints" in LAYERS[-1][1]

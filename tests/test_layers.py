"""The house's layers (docs/design.md "Layers"): no import circle, and no module imports a package
above its own layer.

Every ``import`` counts, also the ones inside functions: a lazy import still ties two modules
together and only hides the circle until the day someone moves it to the top of a file.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: bottom to top; a package may import its own modules and packages of lower layers only
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),
    ("losses", "decoding"),
    ("heads",),
    ("data_prep",),
    ("train", "evaluation"),
    ("scripts", "benchmarks"),
)
LAYER_OF = {pkg: i for i, group in enumerate(LAYERS) for pkg in group}


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the layered packages."""
    mods = {}
    for pkg in LAYER_OF:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = f
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in the file, relative imports resolved)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), filename=str(f))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                hit = _resolve(t, mods)
                if hit is not None and hit != m:
                    graph[m].add(hit)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """``"a.b imports c.d (layer i < j)"`` for each import of a package at the same or a higher layer."""
    out = []
    for m, deps in sorted(graph.items()):
        top = m.split(".")[0]
        for d in sorted(deps):
            other = d.split(".")[0]
            if other != top and LAYER_OF[other] >= LAYER_OF[top]:
                out.append(f"{m} imports {d} (layer {LAYER_OF[top]} {top} may import only layers below it)")
    return out


def test_cycle_and_layer_checks_catch_planted_faults():
    planted = {"core.a": {"core.b"}, "core.b": {"core.a"}, "decoding.x": {"heads.y"}, "heads.y": {"decoding.x"},
               "heads.z": {"decoding.x"}, "losses.l": {"decoding.x"}}
    assert cycles(planted) == [["core.a", "core.b"], ["decoding.x", "heads.y"]]
    assert layer_violations(planted) == [
        "decoding.x imports heads.y (layer 1 decoding may import only layers below it)",
        "losses.l imports decoding.x (layer 1 losses may import only layers below it)"]


def test_no_import_circles():
    found = cycles(import_graph(project_modules()))
    assert not found, "import circles (move the shared piece below both): " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_imports_a_package_above_its_layer():
    bad = layer_violations(import_graph(project_modules()))
    assert not bad, "layer violations (docs/design.md 'Layers'):\n" + "\n".join(bad)


def test_every_package_has_a_layer():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} | {"scripts", "benchmarks"}
    assert packages - {"tests"} <= set(LAYER_OF), sorted(packages - set(LAYER_OF))

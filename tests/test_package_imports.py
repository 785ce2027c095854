"""The package's import graph has no cycle.

Walks every module of ``hpsray`` with :mod:`ast`, takes its module-level imports (also those
inside top-level ``try``/``if`` blocks, but not ``if TYPE_CHECKING:`` ones, nor imports inside
functions, which run later), resolves relative imports and ``from package import submodule``,
and fails on any cycle, naming it. A package's ``__init__`` importing its own submodules is not
counted as importing itself back: a submodule's import of its parent package is implicit in
Python and is not an edge here unless written out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hpsray

ROOT = Path(hpsray.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _top_level_imports(node.body)
            yield from _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _top_level_imports(block)


def _every_import(body: list[ast.stmt]):
    """Every import statement, also under ``if TYPE_CHECKING:`` and inside functions."""
    for stmt in body:
        yield from (n for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom)))


def import_graph(every: bool = False) -> dict[str, set[str]]:
    """Module name -> the hpsray modules it imports at module level (``every``: anywhere)."""
    walk = _every_import if every else _top_level_imports
    mods = _modules()
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        for node in walk(tree.body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                subs = [f"{mod}.{a.name}" for a in node.names]
                # "from pkg import submodule" needs pkg only as the parent package (implicit, as
                # for any submodule); a name defined in pkg's __init__ is an edge to pkg
                targets = subs + ([mod] if any(t not in mods for t in subs) else [])
            for t in targets:
                while t and t not in mods:  # "import a.b.c" where c is not a module: a.b
                    t = t.rpartition(".")[0]
                if t.startswith("hpsray") and t in mods and t != name:
                    graph[name].add(t)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walker_sees_relative_and_from_imports():
    graph = import_graph()
    assert "hpsray.errors" in graph["hpsray.kernels.table"]
    assert "hpsray.tiers.ssd.store" in graph["hpsray.tiers.ssd"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_hpsray_has_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles in hpsray:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_import_cycle_even_through_type_hints_or_functions():
    """Also the imports only a type checker or a later call runs: a part that needs another's type
    takes a protocol of what it reads of it (``pipelines.views``, ``joining.Joining``,
    ``reference_tables.TableTrainer``), so a module reads without the modules above it."""
    graph = import_graph(every=True)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in hpsray:\n" + "\n".join(" <-> ".join(c) for c in cycles)
    assert "hpsray.actors.trainer" in graph["hpsray.pipelines.placement"]


def test_only_the_job_builder_imports_the_pipelines():
    graph = import_graph()
    job = {name: deps for name, deps in graph.items() if name == "hpsray.job" or name.startswith("hpsray.job.")}
    assert job, "hpsray.job is missing"
    importers = {name for name, deps in job.items() if any(d.startswith("hpsray.pipelines") for d in deps)}
    assert importers <= {"hpsray.job.build"}, importers
    assert "hpsray.job" not in graph["hpsray.config"] and not any(
        d.startswith(("hpsray.pipelines", "hpsray.actors", "hpsray.job")) for d in graph["hpsray.config"]
    )


ENGINES = (
    "hpsray.kernels",
    "hpsray.tiers",
    "hpsray.data",
    "hpsray.models",
    "hpsray.training",
    "hpsray.reference",
    "hpsray.config",
    "hpsray.errors",
    "hpsray.env",
    "hpsray.checkpoint",
    "hpsray.export",
    "hpsray.plan",
    "hpsray.cluster.updates",
    "hpsray.report",
)
RAY_LAYERS = (
    "hpsray.actors",
    "hpsray.pipelines",
    "hpsray.cluster",
    "hpsray.job",
    "hpsray.bench",
    "hpsray.cli",
    "hpsray.serving",
)


def test_engines_import_neither_ray_nor_the_layers_above_them():
    """docs/architecture.md, Layers: the engines know no Ray (not even inside a function)."""
    graph = import_graph()
    up = {
        (m, d)
        for m, deps in graph.items()
        if m.startswith(ENGINES)
        for d in deps
        if d.startswith(RAY_LAYERS) and not d.startswith(ENGINES)  # cluster.updates is an engine
    }
    assert not up, up
    for name, path in _modules().items():
        if name.startswith(ENGINES):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and not node.level
                    else []
                )
                assert not any(n == "ray" or n.startswith("ray.") for n in names), f"{name} imports Ray"


def test_the_reference_imports_nothing_of_the_trainer_engine():
    """The oracle stays apart from the system under test: the trainer's step is its own code."""
    graph = import_graph()
    assert not [d for d in graph["hpsray.reference"] if d.startswith(("hpsray.training", "hpsray.actors"))]


def test_nothing_below_the_cli_imports_it():
    """docs/architecture.md, Layers: ``hpsray.cli`` is the top; the benchmarks, the job builder and
    every layer under them import nothing of it, not even inside a function."""
    graph = import_graph(every=True)
    below = [m for m in graph if m != "hpsray.__main__" and not m.startswith("hpsray.cli")]
    up = sorted(
        (name, dep) for name in below for dep in graph[name] if dep == "hpsray.cli" or dep.startswith("hpsray.cli.")
    )
    assert not up, up
    assert {"hpsray.bench.plan", "hpsray.job.probe"} <= set(below)

"""The package's layering, checked over the source tree with ``ast`` (nothing is imported).

1. No import cycle among hvd_trainer modules, counting imports at any depth (inside functions
   and ``if TYPE_CHECKING:`` blocks too).
2. No import of an hvd_trainer module inside a function or method body, except in
   ``hvd_trainer/_register.py`` (the Lightning import hook, which imports the strategy lazily
   by design). Optional third-party dependencies may be imported inside functions.
3. Layer order: comm is the bottom; callbacks/, checkpoint.py and elastic/ sit on comm only;
   torch/, keras/ and launch/ never reach into the other front ends; ray.py (the Ray Train
   one-liner, an optional dependency) sits beside launch/: it may import comm and launch, and
   no hvd_trainer module imports it.
4. Inside comm, a module imports only modules of lower rows of :data:`COMM_ROWS` (the table
   in ``hvd_trainer/comm/__init__.py``'s docstring).

Edges: ``import a.b`` is an edge to ``a.b``; ``from a import b`` is an edge to ``a.b`` when that
is a module, else to ``a``. The implicit import of parent packages is not an edge (every
submodule import runs its parents' ``__init__``; counting it would make every package a cycle).
Each failure prints the offending edges as ``file:line: importer -> imported``.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "hvd_trainer"

FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "keras", "tensorflow")
"""Third-party front-end frameworks (top-level package names)."""

LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")

RAY_MODULE = "hvd_trainer.ray"
"""The Ray Train one-liner: a launcher-level module that nothing in the package imports."""

LAZY_HOOK = "hvd_trainer._register"
"""The one module allowed to import hvd_trainer modules inside a function."""

# Edges allowed to break a rule (importer, imported): none today. Add one only with a comment
# saying why it cannot point down.
ALLOWED_FUNCTION_IMPORTS: set[tuple[str, str]] = set()
ALLOWED_CYCLE_EDGES: set[tuple[str, str]] = set()
ALLOWED_LAYER_EDGES: set[tuple[str, str]] = set()

COMM_ROWS = (
    ("session",),
    ("runtime",),
    ("objects",),
    ("collectives",),
    ("autograd",),
    ("reductions_async", "movement_async", "fusion"),
    ("handle", "reduce", "adasum"),
    ("process_set_registry",),
    ("process_set",),
    ("checks",),
    ("timeline", "build_info", "optimizer_args"),
    ("world", "liveness", "heartbeat", "membership", "join_board", "flatten", "ops", "arguments",
     "compression", "autotune"),
    ("store", "config", "launch_env", "errors", "fatal"),
    ("_torch_compat",),
)
"""The comm layer top to bottom; a module may import only modules of the rows below its own."""


@dataclass(frozen=True, slots=True)
class Edge:
    """One import statement's target, as seen in the importer's source."""

    importer: str
    imported: str
    path: Path
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = " (inside a function)" if self.in_function else ""
        path = self.path.relative_to(PACKAGE_DIR.parent)
        return f"{path}:{self.line}: {self.importer} -> {self.imported}{where}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@functools.cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


class _ImportCollector(ast.NodeVisitor):
    """Every import in a module, with whether it sits inside a function body."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
        self._depth = 0

    def _function(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append((node, self._depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node, self._depth > 0))


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Absolute names imported by ``node`` (submodules resolved, see the module docstring)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([node.module] if node.module else [])])
    out = []
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        out.append(candidate if candidate in _modules() else base)
    return out


@functools.cache
def _all_imports() -> tuple[Edge, ...]:
    """Every import of every hvd_trainer module, third-party ones included."""
    edges = []
    for module, path in _modules().items():
        collector = _ImportCollector()
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        for node, in_function in collector.found:
            for target in _targets(module, path, node):
                edges.append(Edge(module, target, path, node.lineno, in_function))
    return tuple(edges)


def _internal_edges() -> list[Edge]:
    return [e for e in _all_imports() if _is_ours(e.imported) and e.imported != e.importer]


def _is_ours(name: str) -> bool:
    return name == "hvd_trainer" or name.startswith("hvd_trainer.")


def _in(name: str, *prefixes: str) -> bool:
    """Whether module ``name`` is one of ``prefixes`` or inside one of them."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _report(title: str, edges: Iterable[Edge]) -> str:
    lines = sorted({str(e) for e in edges})
    return f"{title} ({len(lines)}):\n  " + "\n  ".join(lines)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: groups of modules that all reach each other (more than one module).
    Quadratic, which is fine for a hundred modules."""
    reach = {node: _reachable(graph, node) for node in graph}
    components: list[list[str]] = []
    placed: set[str] = set()
    for node in sorted(graph):
        if node in placed or node not in reach[node]:
            continue
        component = sorted(other for other in reach[node] if node in reach[other])
        placed.update(component)
        components.append(component)
    return components


def test_the_source_tree_is_parsed() -> None:
    """Guards the other tests against passing on an empty or misplaced tree."""
    modules = _modules()
    assert {"hvd_trainer", "hvd_trainer.comm", "hvd_trainer.comm.session", "hvd_trainer.strategy"} <= set(
        modules
    )
    assert any(e.in_function for e in _all_imports())  # e.g. the import hook, mpi4py


def test_no_import_cycle() -> None:
    edges = [e for e in _internal_edges() if (e.importer, e.imported) not in ALLOWED_CYCLE_EDGES]
    graph: dict[str, set[str]] = {m: set() for m in _modules()}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
    cycles = _strongly_connected(graph)
    details = []
    for component in cycles:
        members = set(component)
        inside = [e for e in edges if e.importer in members and e.imported in members]
        details.append(_report(f"cycle among {component}", inside))
    assert not cycles, "\n".join(details)


def test_no_package_import_inside_a_function() -> None:
    bad = [
        e for e in _internal_edges()
        if e.in_function and e.importer != LAZY_HOOK
        and (e.importer, e.imported) not in ALLOWED_FUNCTION_IMPORTS
    ]
    assert not bad, _report("hvd_trainer modules imported inside a function", bad)


def _layer_violations() -> list[Edge]:
    bad = []
    for e in _all_imports():
        if (e.importer, e.imported) in ALLOWED_LAYER_EDGES:
            continue
        if not _allowed(e.importer, e.imported):
            bad.append(e)
    return bad


def _allowed(importer: str, imported: str) -> bool:
    ours = _is_ours(imported)
    if _in(imported, RAY_MODULE) and importer != RAY_MODULE:
        return False  # optional dependency: importing it anywhere would make ray required
    if importer == RAY_MODULE:
        return _in(imported, "hvd_trainer.comm", "hvd_trainer.launch") if ours else True
    if _in(importer, "hvd_trainer.comm"):
        return _in(imported, "hvd_trainer.comm") if ours else not _in(imported, *FRAMEWORKS)
    if _in(importer, "hvd_trainer.callbacks", "hvd_trainer.checkpoint", "hvd_trainer.elastic"):
        below = ("hvd_trainer.comm", "hvd_trainer.callbacks", "hvd_trainer.checkpoint", "hvd_trainer.elastic")
        if ours:
            return _in(imported, *below)
        return not (_in(importer, "hvd_trainer.elastic") and _in(imported, *LIGHTNING))
    if _in(importer, "hvd_trainer.torch"):
        return not _in(imported, *FRAMEWORKS, "hvd_trainer.lightning", "hvd_trainer.keras",
                       "hvd_trainer.strategy", "hvd_trainer._register")
    if _in(importer, "hvd_trainer.keras"):
        # ``from hvd_trainer import comm`` resolves to hvd_trainer.comm; plain "hvd_trainer" is
        # ``import hvd_trainer`` or a name from hvd_trainer/__init__.
        return not (imported == "hvd_trainer" or _in(imported, "hvd_trainer.torch", "hvd_trainer.strategy",
                                                     "hvd_trainer.lightning", "hvd_trainer._register"))
    if _in(importer, "hvd_trainer.launch"):
        return _in(imported, "hvd_trainer.comm", "hvd_trainer.launch") if ours else True
    return True


def test_lower_layers_never_import_upper_ones() -> None:
    bad = _layer_violations()
    assert not bad, _report("imports that point up (or across front ends)", bad)


def test_comm_modules_import_only_lower_rows() -> None:
    row = {f"hvd_trainer.comm.{name}": i for i, names in enumerate(COMM_ROWS) for name in names}
    modules = {m for m in _modules() if m.startswith("hvd_trainer.comm.")}
    assert modules == set(row), (
        f"comm modules missing from COMM_ROWS: {sorted(modules - set(row))}; listed but absent: "
        f"{sorted(set(row) - modules)}. HINT: put a new module in a row above every "
        "module it imports and below every module that imports it, here and in the table of "
        "hvd_trainer/comm/__init__.py."
    )
    bad = [
        e for e in _internal_edges()
        if e.importer in row and e.imported in row and row[e.imported] <= row[e.importer]
    ]
    assert not bad, _report("comm imports that do not point to a lower row of COMM_ROWS", bad)


def test_the_rules_see_violations() -> None:
    """The checks above would fail on the edges they exist to catch."""
    assert not _allowed("hvd_trainer.comm.world", "hvd_trainer.strategy")
    assert not _allowed("hvd_trainer.comm.fusion", "pytorch_lightning.utilities")
    assert not _allowed("hvd_trainer.elastic.state", "lightning.pytorch")
    assert not _allowed("hvd_trainer.checkpoint", "hvd_trainer.lightning.checkpoint_io")
    assert not _allowed("hvd_trainer.torch.optimizer", "keras")
    assert not _allowed("hvd_trainer.keras.optimizer", "hvd_trainer")
    assert not _allowed("hvd_trainer.keras.optimizer", "hvd_trainer.torch.state_sync")
    assert not _allowed("hvd_trainer.launch.cli", "hvd_trainer.elastic")
    assert not _allowed("hvd_trainer", "hvd_trainer.ray")
    assert not _allowed("hvd_trainer.launch.run_fn", "hvd_trainer.ray")
    assert not _allowed("hvd_trainer.ray", "hvd_trainer.strategy")
    assert _allowed("hvd_trainer.ray", "hvd_trainer.comm.world")
    assert _allowed("hvd_trainer.ray", "ray.train.torch")
    assert _allowed("hvd_trainer.keras.collectives", "hvd_trainer.comm")
    assert _allowed("hvd_trainer.comm.launch_env", "mpi4py")
    assert _strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    source = "def f():\n    from hvd_trainer.comm import world\nimport hvd_trainer.comm.ops\n"
    collector = _ImportCollector()
    collector.visit(ast.parse(source))
    assert [(type(n).__name__, inside) for n, inside in collector.found] == [
        ("ImportFrom", True), ("Import", False)
    ]

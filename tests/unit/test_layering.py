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
5. comm's sub-packages are layers, bottom to top :data:`COMM_SUBPACKAGES` (base < world < ops <
   reduce), with comm's own top-level modules (:data:`COMM_TOP`: session, gradient_sync, runtime,
   sync_options) above them: a module never imports one of a higher sub-package.
6. Outside comm, a module imports comm only through its public face, ``hvd_trainer.comm`` (its
   ``__init__``): never one of comm's modules (:func:`_reaches_into_comm`).

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

# Edges allowed to break a rule (importer, imported). Add one only with a comment saying why it
# cannot point down.
ALLOWED_FUNCTION_IMPORTS: set[tuple[str, str]] = {
    # hvd-train reads and checks the config (and prints its errors) before torch is imported; the
    # comm session is needed only once the recipe runs (tests/unit/test_train_cli_fast.py).
    ("hvd_trainer.launch.train_cli", "hvd_trainer.comm"),
}
ALLOWED_CYCLE_EDGES: set[tuple[str, str]] = set()
ALLOWED_LAYER_EDGES: set[tuple[str, str]] = set()

COMM_ROWS = (
    ("session",),
    ("gradient_sync",),
    ("runtime", "sync_options"),
    # zero/
    ("zero.sharding",),
    ("zero.reducer", "zero.pieces"),
    ("zero.collectives",),
    ("zero.plan", "zero.stage"),
    # reduce/
    ("reduce.fusion", "reduce.auto"),
    ("reduce.bucket_hooks",),
    ("reduce.hierarchical.allreduce", "reduce.compressed.reductions", "reduce.localsgd.outer"),
    ("reduce.hierarchical.topology", "reduce.autotune", "reduce.link_probe", "reduce.compressed.int8",
     "reduce.compressed.powersgd"),
    # ops/
    ("ops.objects",),
    ("ops.collectives",),
    ("ops.autograd", "ops.by_name"),
    ("ops.reductions_async", "ops.movement_async"),
    ("ops.handle", "ops.reduce", "ops.adasum"),
    ("ops.process_set_registry",),
    ("ops.process_set",),
    ("ops.checks",),
    ("ops.timeline", "ops.optimizer_args"),
    ("ops.flatten", "ops.ops", "ops.arguments", "ops.compression"),
    # world/
    ("world.build_info",),
    ("world.quorum",),
    ("world.world", "world.liveness", "world.heartbeat", "world.membership", "world.join_board"),
    # base/
    ("base.store", "base.config", "base.launch_env", "base.errors", "base.fatal", "base.future_work"),
    ("base._torch_compat",),
)
"""The comm layer top to bottom (names relative to ``hvd_trainer.comm``), grouped by
sub-package; a module may import only modules of the rows below its own."""

COMM_SUBPACKAGES = ("base", "world", "ops", "reduce", "zero")
"""comm's sub-packages, bottom to top: a module may import modules of its own sub-package or of
a lower one, never of a higher one."""

COMM_TOP = ("session", "gradient_sync", "runtime", "sync_options")
"""comm's modules outside the sub-packages; they (and ``hvd_trainer.comm`` itself) sit above
every sub-package."""


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
    modules = {
        m for m, path in _modules().items()
        if m.startswith("hvd_trainer.comm.") and path.name != "__init__.py"
    }
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


def _comm_level(module: str) -> int:
    """Where comm module ``module`` sits: its sub-package's index in :data:`COMM_SUBPACKAGES`
    (a sub-package's own ``__init__`` included), ``len(COMM_SUBPACKAGES)`` for the top level."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[2] in COMM_SUBPACKAGES:
        return COMM_SUBPACKAGES.index(parts[2])
    return len(COMM_SUBPACKAGES)


def _comm_points_up(importer: str, imported: str) -> bool:
    """Whether an import between two comm modules goes to a higher sub-package."""
    return _comm_level(imported) > _comm_level(importer)


def test_comm_subpackages_import_only_lower_ones() -> None:
    comm = PACKAGE_DIR / "comm"
    subpackages = {p.parent.name for p in comm.glob("*/__init__.py")}
    top = {p.stem for p in comm.glob("*.py") if p.name != "__init__.py"}
    assert subpackages == set(COMM_SUBPACKAGES) and top == set(COMM_TOP), (
        f"comm's sub-packages {sorted(subpackages)} and top-level modules {sorted(top)} differ from "
        f"COMM_SUBPACKAGES {sorted(COMM_SUBPACKAGES)} and COMM_TOP {sorted(COMM_TOP)}. HINT: put a "
        "new module into the lowest sub-package that holds everything it imports; a new "
        "sub-package needs its place in COMM_SUBPACKAGES, here and in hvd_trainer/comm/__init__.py."
    )
    levels = [max(_comm_level(f"hvd_trainer.comm.{name}") for name in names) for names in COMM_ROWS]
    assert levels == sorted(levels, reverse=True), "COMM_ROWS must be grouped by sub-package, top to bottom"
    bad = [
        e for e in _internal_edges()
        if _in(e.importer, "hvd_trainer.comm") and _in(e.imported, "hvd_trainer.comm")
        and _comm_points_up(e.importer, e.imported)
    ]
    assert not bad, _report(
        f"comm imports that point to a higher sub-package ({' < '.join((*COMM_SUBPACKAGES, 'session'))})", bad
    )


def _reaches_into_comm(importer: str, imported: str) -> bool:
    """Whether a module outside comm imports one of comm's modules instead of ``hvd_trainer.comm``."""
    return not _in(importer, "hvd_trainer.comm") and imported.startswith("hvd_trainer.comm.")


def test_upper_layers_use_comms_public_face() -> None:
    bad = [e for e in _internal_edges() if _reaches_into_comm(e.importer, e.imported)]
    assert not bad, _report(
        "imports of comm's modules from outside comm (HINT: import the name from hvd_trainer.comm; "
        "a name it lacks goes into the front ends' block of hvd_trainer/comm/__init__.py)", bad
    )


def test_the_rules_see_violations() -> None:
    """The checks above would fail on the edges they exist to catch."""
    assert not _allowed("hvd_trainer.comm.world.world", "hvd_trainer.strategy")
    assert not _allowed("hvd_trainer.comm.reduce.fusion", "pytorch_lightning.utilities")
    assert not _allowed("hvd_trainer.elastic.state", "lightning.pytorch")
    assert not _allowed("hvd_trainer.checkpoint", "hvd_trainer.lightning.checkpoint_io")
    assert not _allowed("hvd_trainer.torch.optimizer", "keras")
    assert not _allowed("hvd_trainer.keras.optimizer", "hvd_trainer")
    assert not _allowed("hvd_trainer.keras.optimizer", "hvd_trainer.torch.state_sync")
    assert not _allowed("hvd_trainer.launch.cli", "hvd_trainer.elastic")
    assert not _allowed("hvd_trainer", "hvd_trainer.ray")
    assert not _allowed("hvd_trainer.launch.run_fn", "hvd_trainer.ray")
    assert not _allowed("hvd_trainer.ray", "hvd_trainer.strategy")
    assert _allowed("hvd_trainer.ray", "hvd_trainer.comm.world.world")
    assert _allowed("hvd_trainer.ray", "ray.train.torch")
    assert _allowed("hvd_trainer.keras.collectives", "hvd_trainer.comm")
    assert _allowed("hvd_trainer.comm.base.launch_env", "mpi4py")
    assert _reaches_into_comm("hvd_trainer.torch.optimizer", "hvd_trainer.comm.zero")
    assert _reaches_into_comm("hvd_trainer.strategy", "hvd_trainer.comm.reduce.fusion")
    assert not _reaches_into_comm("hvd_trainer.strategy", "hvd_trainer.comm")
    assert not _reaches_into_comm("hvd_trainer.comm.session", "hvd_trainer.comm.zero.sharding")
    assert _comm_points_up("hvd_trainer.comm.base.store", "hvd_trainer.comm.world.liveness")
    assert _comm_points_up("hvd_trainer.comm.ops.collectives", "hvd_trainer.comm.reduce.fusion")
    assert _comm_points_up("hvd_trainer.comm.reduce.fusion", "hvd_trainer.comm.session")
    assert _comm_points_up("hvd_trainer.comm.world.world", "hvd_trainer.comm")
    assert not _comm_points_up("hvd_trainer.comm.session", "hvd_trainer.comm.reduce.fusion")
    assert not _comm_points_up("hvd_trainer.comm.ops.checks", "hvd_trainer.comm.world.heartbeat")
    assert _strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    source = "def f():\n    from hvd_trainer.comm.world import world\nimport hvd_trainer.comm.ops.ops\n"
    collector = _ImportCollector()
    collector.visit(ast.parse(source))
    assert [(type(n).__name__, inside) for n, inside in collector.found] == [
        ("ImportFrom", True), ("Import", False)
    ]

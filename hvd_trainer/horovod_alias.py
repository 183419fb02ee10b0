"""``import horovod...`` served by hvd_trainer: run a Horovod script with no edit at all.

``hvdrun --as-horovod -np 2 python train.py`` installs this alias in every worker (a
``sitecustomize`` on the workers' ``PYTHONPATH``, see :mod:`hvd_trainer.launch._horovod_shim`);
in a notebook, a Ray task or any other process, import this module first::

    import hvd_trainer.horovod_alias       # installs the alias (no effect if Horovod is installed)
    import horovod
    import horovod.torch as hvd            # is hvd_trainer.torch

What resolves to what:

==============================================  ===================================================
``horovod``                                     a small package: ``horovod.run`` (=
                                                ``hvd_trainer.run``), ``horovod.__version__``
``horovod.torch`` and ``horovod.torch.X``       ``hvd_trainer.torch`` and ``hvd_trainer.torch.X``
                                                (``elastic``, ``mpi_ops``, ``functions``,
                                                ``compression``, ``optimizer``; ``sync_batch_norm``
                                                is ``hvd_trainer.torch.sync_batchnorm``)
``horovod.tensorflow.keras``, ``horovod.keras``  ``hvd_trainer.keras`` (and its submodules:
                                                ``callbacks``, ``elastic``)
``horovod.tensorflow``                          a package whose names are ``hvd_trainer.keras``'s
                                                (``init``, ``rank``, ``allreduce``, ...)
``horovod.runner``                              a package with ``run``
``horovod.runner.util.threads``                 ``hvd_trainer.horovod_threads`` (``in_thread``, ...;
                                                Horovod's test helpers import it)
``horovod.common.exceptions``                   ``HorovodInternalError``, ``HostsUpdatedInterrupt``
==============================================  ===================================================

While the alias is installed, ``reducescatter``'s gradient has Horovod's scale (the set size
times the exact adjoint: ``HVD_TRAINER_REDUCESCATTER_GRAD=horovod``, set by :func:`install`
unless the variable is already set, removed again by :func:`uninstall`).

Anything else under ``horovod.`` (``horovod.spark``, ``horovod.ray``, ``horovod.mxnet``, a
module hvd_trainer lacks) raises ``ModuleNotFoundError`` naming what to use instead.

Never shadowing a real Horovod: the finder sits first in ``sys.meta_path`` (so that
``horovod.torch.elastic`` is not loaded a second time from ``hvd_trainer/torch/elastic.py``
under another name), but it serves the top-level ``horovod`` only when no other finder
finds one, i.e. when Horovod is not installed; the submodules follow whichever ``horovod``
was imported. ``install(force=True)`` (``hvdrun --as-horovod=force``) serves ``horovod`` even
when Horovod is installed. Aliased modules are the very hvd_trainer modules
(``horovod.torch is hvd_trainer.torch``): one copy of every module and of its state.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Sequence

from hvd_trainer.comm import REDUCESCATTER_GRAD_ENV

__all__ = ["install", "uninstall", "is_installed", "target_of", "HorovodAliasFinder"]

_ALIASED_PREFIXES = (
    ("horovod.tensorflow.keras", "hvd_trainer.keras"),
    ("horovod.keras", "hvd_trainer.keras"),
    ("horovod.torch", "hvd_trainer.torch"),
)
"""Horovod package prefix -> the hvd_trainer package serving it (longest prefix first)."""

_RENAMED = {"horovod.torch.sync_batch_norm": "hvd_trainer.torch.sync_batchnorm"}
"""Horovod modules whose hvd_trainer counterpart has another name."""

_MISSING_HINTS = {
    "horovod.ray": "use hvd_trainer.ray.run(fn, num_workers=N) (README: Run on your cluster, Ray Train)",
    "horovod.spark": "use pyspark's TorchDistributor with hvd.init() inside (README: Run on your cluster)",
    "horovod.mxnet": "MXNet is not supported; hvd_trainer serves torch, Lightning and Keras 3",
    "horovod.tensorflow.mpi_ops": "use horovod.tensorflow.keras (hvd_trainer.keras) collectives",
}
"""Horovod packages hvd_trainer does not serve, with what to do instead."""

_MARK = "__hvd_trainer_alias__"
"""Attribute set on every module this file synthesizes (``horovod`` itself among them)."""


def _hvd_run(*args: object, **kwargs: object) -> object:
    """``horovod.run``: :func:`hvd_trainer.run` (imported when first called)."""
    return importlib.import_module("hvd_trainer.launch.run_fn").run(*args, **kwargs)


def _package(name: str, doc: str, names: dict[str, object],
             delegate: str | None = None) -> types.ModuleType:
    """A synthesized package ``name`` holding ``names``; other attributes come from ``delegate``."""
    module = types.ModuleType(name, doc)
    module.__path__ = []  # a package: its submodules are looked up (by our finder)
    module.__dict__.update(names)
    setattr(module, _MARK, True)
    if delegate is not None:
        def __getattr__(attr: str) -> object:  # noqa: N807 (module-level __getattr__, PEP 562)
            if attr.startswith("__"):
                raise AttributeError(attr)
            return getattr(importlib.import_module(delegate), attr)

        module.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return module


def _exceptions() -> dict[str, object]:
    errors = importlib.import_module("hvd_trainer.comm.base.errors")
    return {"HorovodInternalError": errors.HorovodInternalError,
            "HostsUpdatedInterrupt": errors.HostsUpdatedInterrupt}


_SYNTHESIZED: dict[str, Callable[[], types.ModuleType]] = {
    "horovod": lambda: _package(
        "horovod", "Horovod's top-level package, served by hvd_trainer (hvd_trainer.horovod_alias).",
        {"run": _hvd_run, "__version__": importlib.import_module("hvd_trainer").__version__}),
    "horovod.runner": lambda: _package("horovod.runner", "horovod.runner.run = hvd_trainer.run.",
                                       {"run": _hvd_run}),
    "horovod.runner.util": lambda: _package("horovod.runner.util", "Horovod's runner utilities.", {}),
    "horovod.runner.util.threads": lambda: _package(
        "horovod.runner.util.threads", "in_thread, on_event, execute_function_multithreaded.", {},
        delegate="hvd_trainer.horovod_threads"),
    "horovod.tensorflow": lambda: _package(
        "horovod.tensorflow", "Horovod's TensorFlow names, served by hvd_trainer.keras.", {},
        delegate="hvd_trainer.keras"),
    "horovod.common": lambda: _package("horovod.common", "Horovod's common package (exceptions only).", {}),
    "horovod.common.exceptions": lambda: _package(
        "horovod.common.exceptions", "HorovodInternalError and HostsUpdatedInterrupt.", _exceptions()),
}


def target_of(name: str) -> str | None:
    """The hvd_trainer module serving Horovod module ``name``; ``None`` for a synthesized one.

    Raises:
        ModuleNotFoundError: ``name`` is a Horovod module hvd_trainer does not serve.
    """
    if name in _SYNTHESIZED:
        return None
    if name in _RENAMED:
        return _RENAMED[name]
    for prefix, target in _ALIASED_PREFIXES:
        if name == prefix or name.startswith(prefix + "."):
            return target + name[len(prefix):]
    hint = next((h for p, h in _MISSING_HINTS.items() if name == p or name.startswith(p + ".")),
                "hvd_trainer serves horovod.torch, horovod.keras, horovod.tensorflow(.keras), horovod.run")
    raise ModuleNotFoundError(f"No module named {name!r} (hvd_trainer's Horovod alias). HINT: {hint}.",
                              name=name)


class _AliasLoader(importlib.abc.Loader):
    """Loads a Horovod module name as the hvd_trainer module serving it (the same object)."""

    def __init__(self, target: str | None) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        if self.target is None:
            return _SYNTHESIZED[spec.name]()
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module: types.ModuleType) -> None:
        if self.target is None:
            return
        # The import system returns whatever sys.modules holds under the name after exec_module,
        # so the alias *is* the hvd_trainer module (its own __spec__ and __name__ untouched).
        sys.modules[module.__name__] = importlib.import_module(self.target)


class HorovodAliasFinder(importlib.abc.MetaPathFinder):
    """The meta-path finder behind :func:`install` (see the module docstring)."""

    def __init__(self, force: bool = False) -> None:
        self.force = force
        self.set_grad_env = False
        """Whether :func:`install` set ``HVD_TRAINER_REDUCESCATTER_GRAD`` (uninstall removes it)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "horovod":
            if not self.force and self._found_elsewhere(fullname):
                return None  # a real Horovod is installed: it wins
        elif not fullname.startswith("horovod.") or not getattr(sys.modules.get("horovod"), _MARK, False):
            return None
        serving = target_of(fullname)
        if serving is not None and importlib.util.find_spec(serving) is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: hvd_trainer's Horovod alias maps it to {serving!r}, "
                "which does not exist. HINT: the README's porting notes list what hvd_trainer offers.",
                name=fullname)
        found = None if serving is None else importlib.util.find_spec(serving)
        is_package = found is None or found.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(serving), is_package=is_package)

    def _found_elsewhere(self, fullname: str) -> bool:
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, HorovodAliasFinder):
                continue
            find = getattr(finder, "find_spec", None)
            if find is not None and find(fullname, None) is not None:
                return True
        return False


_FINDER = HorovodAliasFinder()


def install(force: bool = False) -> None:
    """Serve ``import horovod...`` from hvd_trainer in this process (idempotent).

    Args:
        force: serve ``horovod`` even when a real Horovod is installed (it is then shadowed in
            this process; a Horovod imported before this call stays what it is).
    """
    _FINDER.force = force
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    if REDUCESCATTER_GRAD_ENV not in os.environ:  # Horovod's numbers for Horovod's code
        os.environ[REDUCESCATTER_GRAD_ENV] = "horovod"
        _FINDER.set_grad_env = True


def uninstall() -> None:
    """Stop serving ``horovod`` and forget the aliased ``horovod.*`` modules of this process."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    if _FINDER.set_grad_env:
        os.environ.pop(REDUCESCATTER_GRAD_ENV, None)
        _FINDER.set_grad_env = False
    if getattr(sys.modules.get("horovod"), _MARK, False):
        for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
            del sys.modules[name]


def is_installed() -> bool:
    """Whether this process serves ``import horovod`` from hvd_trainer (when not installed)."""
    return _FINDER in sys.meta_path


install()

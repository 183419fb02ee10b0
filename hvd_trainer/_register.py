"""Make ``Trainer(strategy="horovod")`` work once ``hvd_trainer`` is imported (idempotent).

``pytorch_lightning`` and the ``lightning`` package's ``lightning.pytorch`` keep separate
registries with separate ``Strategy`` base classes, so each gets its own class.

Importing Lightning costs seconds, which every ``hvdrun`` start and every worker of a torch- or
Keras-only job would pay. So a Lightning package that is already imported is registered at once,
and one that is not gets registered the moment its import completes (a finder on
``sys.meta_path`` wraps that package's loader); either way the registry holds ``"horovod"``
before any ``Trainer`` can be built.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["register", "register_pytorch_lightning", "register_lightning_pytorch", "RegisterOnImport"]


def _strategy_module_importing() -> bool:
    """True while ``hvd_trainer.strategy`` itself is being imported (it imports Lightning, which
    fires the hook); that module registers itself when it is complete."""
    module = sys.modules.get("hvd_trainer.strategy")
    return module is not None and not hasattr(module, "lightning_pytorch_strategy_class")


def register_pytorch_lightning() -> None:
    """Register ``"horovod"`` in ``pytorch_lightning.strategies.StrategyRegistry``."""
    if _strategy_module_importing():
        return
    from pytorch_lightning.strategies import StrategyRegistry

    strategy = importlib.import_module("hvd_trainer.strategy")  # registers itself on first import

    if "horovod" not in StrategyRegistry:
        strategy.HorovodStrategy.register_strategies(StrategyRegistry)


def register_lightning_pytorch() -> None:
    """Register ``"horovod"`` in ``lightning.pytorch.strategies.StrategyRegistry``."""
    if _strategy_module_importing():
        return
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.strategies import StrategyRegistry as LightningRegistry
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    strategy = importlib.import_module("hvd_trainer.strategy")
    porting = importlib.import_module("hvd_trainer.lightning.porting")

    if "horovod" not in LightningRegistry:
        strategy.lightning_pytorch_strategy_class().register_strategies(LightningRegistry)
    porting.install(_AcceleratorConnector, AcceleratorRegistry, SingleDeviceStrategy)


_TARGETS: dict[str, Callable[[], None]] = {
    "pytorch_lightning": register_pytorch_lightning,
    "lightning.pytorch": register_lightning_pytorch,
}


def _safe(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - never break the user's own Lightning import
        warnings.warn(
            f"hvd_trainer could not register Trainer(strategy='horovod'): {exc!r}. "
            "HINT: pass HorovodStrategy() from hvd_trainer.strategy explicitly.",
            stacklevel=2,
        )


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader, then the registration for that package."""

    def __init__(self, inner: importlib.abc.Loader, after: Callable[[], None]) -> None:
        self._inner = inner
        self._after = after

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _safe(self._after)

    def __getattr__(self, name: str) -> Any:  # resource readers, is_package, get_code, ...
        return getattr(self._inner, name)


class RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of the Lightning packages named in ``pending``."""

    def __init__(self, pending: dict[str, Callable[[], None]]) -> None:
        self.pending = pending

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        after = self.pending.pop(fullname, None)
        if after is None:
            return None
        spec = importlib.util.find_spec(fullname)  # the real finders (we no longer match it)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisteringLoader(spec.loader, after)
        return spec


def register() -> None:
    """Register now with every Lightning package already imported; defer the others."""
    pending: dict[str, Callable[[], None]] = {}
    for name, fn in _TARGETS.items():
        if name in sys.modules:
            _safe(fn)
        else:
            pending[name] = fn
    if pending and not any(isinstance(f, RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, RegisterOnImport(pending))

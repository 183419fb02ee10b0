"""Register ``"horovod"`` in Lightning's strategy registries at import time (idempotent).

``pytorch_lightning`` and the ``lightning`` package's ``lightning.pytorch`` keep separate
registries with separate ``Strategy`` base classes, so each gets its own class.
"""

from __future__ import annotations

import importlib.util

_DESCRIPTION = "hvd_trainer: Horovod-style fused allreduce on torch.distributed"

__all__ = ["register"]


def _lightning_pytorch_installed() -> bool:
    try:
        return importlib.util.find_spec("lightning.pytorch") is not None
    except ModuleNotFoundError:  # no "lightning" parent package
        return False


def register() -> None:
    """Register with ``pytorch_lightning`` and, when installed, ``lightning.pytorch``."""
    if importlib.util.find_spec("pytorch_lightning") is not None:
        from pytorch_lightning.strategies import StrategyRegistry

        from hvd_trainer.strategy import HorovodStrategy

        if "horovod" not in StrategyRegistry:
            StrategyRegistry.register("horovod", HorovodStrategy, description=_DESCRIPTION)
    if _lightning_pytorch_installed():
        from lightning.pytorch.strategies import StrategyRegistry as LightningRegistry

        from hvd_trainer.strategy import lightning_pytorch_strategy_class

        if "horovod" not in LightningRegistry:
            LightningRegistry.register(
                "horovod", lightning_pytorch_strategy_class(), description=_DESCRIPTION
            )


try:
    register()
except ModuleNotFoundError as exc:  # strategy not importable yet: comm API still usable
    if exc.name not in ("hvd_trainer.strategy", "pytorch_lightning"):
        raise

"""Register ``"horovod"`` in Lightning's strategy registries at import time (idempotent)."""

from __future__ import annotations

import importlib.util

_DESCRIPTION = "hvd_trainer: Horovod-style fused allreduce on torch.distributed"


def register() -> None:
    """Register with ``pytorch_lightning`` and, when installed, ``lightning.pytorch``."""
    if importlib.util.find_spec("pytorch_lightning") is not None:
        from pytorch_lightning.strategies import StrategyRegistry

        from hvd_trainer.strategy import HorovodStrategy

        if "horovod" not in StrategyRegistry:
            StrategyRegistry.register("horovod", HorovodStrategy, description=_DESCRIPTION)


try:
    register()
except ModuleNotFoundError as exc:  # strategy not importable yet: comm API still usable
    if exc.name not in ("hvd_trainer.strategy", "pytorch_lightning"):
        raise

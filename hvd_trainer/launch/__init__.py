"""``hvdrun``: Horovod-style flags translated into a torchrun (or mpirun) command.

The names below are imported on first use, so ``hvd_trainer.launch.train_cli`` (``hvd-train``)
does not pay for hvdrun's modules.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {"build_torchrun_command": "cli", "main": "cli", "HvdrunError": "errors",
          "HvdrunOptions": "options", "parse_options": "options"}

__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"hvd_trainer.launch.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'hvd_trainer.launch' has no attribute {name!r}")

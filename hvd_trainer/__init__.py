"""hvd_trainer: Horovod-style distributed training on torch.distributed.

``import hvd_trainer as hvd`` reads like ``import horovod.torch as hvd``::

    hvd.init()
    print(hvd.rank(), hvd.size())
    avg = hvd.allreduce(torch.ones(3))          # average over ranks

The names are those of :mod:`hvd_trainer.torch` (``import hvd_trainer.torch as hvd`` is the
same API), imported at the first use of one of them. Importing the package also registers
``Trainer(strategy="horovod")`` with Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

from hvd_trainer import _register

__version__ = "0.1.0"

_API = "hvd_trainer.torch"


def _api() -> Any:
    return importlib.import_module(_API)  # also sets this package's ``torch`` attribute


def __getattr__(name: str) -> Any:
    """The Horovod torch names, imported on first use: ``import hvd_trainer`` alone imports no
    torch, so ``hvdrun``, ``hvd-train``'s config errors and a Keras-only worker start fast."""
    if name == "__all__":
        return ["__version__", *_api().__all__]
    if name.startswith("__"):
        raise AttributeError(name)
    api = _api()
    if name in globals():  # the ``torch`` submodule, now imported
        return globals()[name]
    if name in api.__all__:
        return getattr(api, name)
    raise AttributeError(f"module 'hvd_trainer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_api().__all__})


_register.register()  # Trainer(strategy="horovod"), now or when Lightning is imported

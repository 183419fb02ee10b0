"""hvd_trainer: Horovod-style distributed training on torch.distributed.

``import hvd_trainer as hvd`` reads like ``import horovod.torch as hvd``::

    hvd.init()
    print(hvd.rank(), hvd.size())
    avg = hvd.allreduce(torch.ones(3))          # average over ranks

The names are those of :mod:`hvd_trainer.torch` (``import hvd_trainer.torch as hvd`` is the
same API). Importing the package also registers ``Trainer(strategy="horovod")`` with Lightning.
"""

from __future__ import annotations

from hvd_trainer import _register
from hvd_trainer import torch as _torch_api
from hvd_trainer.torch import *  # noqa: F403  (the Horovod torch names; __all__ below)

__version__ = "0.1.0"

__all__ = ["__version__", *_torch_api.__all__]

_register.register()  # Trainer(strategy="horovod"), now or when Lightning is imported

"""``horovod.torch.mpi_ops``'s module path: the collectives, handles, reduce ops, process sets and
build facts of :mod:`hvd_trainer.comm`, under the name Horovod users import them from
(``from horovod.torch.mpi_ops import allreduce_async_`` becomes
``from hvd_trainer.torch.mpi_ops import allreduce_async_``), and Horovod's ``_basics``."""

from __future__ import annotations

from hvd_trainer import comm as _comm
from hvd_trainer.comm import *  # noqa: F403 - the module is a re-export of comm's public names

__all__ = list(_comm.__all__)

_basics = _comm.HorovodBasics()
"""``horovod.torch.mpi_ops._basics``: its process-set query."""

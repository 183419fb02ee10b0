"""What Horovod code reaches as ``horovod.tensorflow``'s ``mpi_ops._basics`` (its process-set
query, :class:`~hvd_trainer.comm.HorovodBasics`); the collectives are :mod:`hvd_trainer.keras`'s."""

from __future__ import annotations

from hvd_trainer.comm import HorovodBasics

__all__: list[str] = []

_basics = HorovodBasics()
"""``horovod.tensorflow.mpi_ops._basics``: its process-set query."""

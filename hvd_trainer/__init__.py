"""hvd_trainer: Horovod-style distributed training on torch.distributed.

``import hvd_trainer as hvd`` reads like ``import horovod.torch as hvd``::

    hvd.init()
    print(hvd.rank(), hvd.size())
    avg = hvd.allreduce(torch.ones(3))          # average over ranks

Importing the package also registers ``Trainer(strategy="horovod")`` with Lightning.
"""

from __future__ import annotations

from hvd_trainer.comm import (
    Average,
    CollectiveMismatchError,
    CommConfig,
    Compression,
    Handle,
    JoinedRankError,
    Max,
    Min,
    NotInitializedError,
    ProcessSet,
    Product,
    RankFailedError,
    ReduceOp,
    StallError,
    Sum,
    World,
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    get_world,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    is_initialized,
    join,
    poll,
    reducescatter,
    shutdown,
    synchronize,
)
from hvd_trainer.comm import init as _comm_init

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "init", "shutdown", "is_initialized", "get_world", "World",
    "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "poll", "synchronize", "Handle",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "allgather", "broadcast", "broadcast_", "alltoall", "reducescatter", "barrier", "join",
    "broadcast_object", "allgather_object", "ProcessSet", "Compression",
    "Average", "Sum", "Min", "Max", "Product", "ReduceOp",
    "CollectiveMismatchError", "NotInitializedError", "StallError", "JoinedRankError",
    "RankFailedError",
]


def init(
    *, backend: str | None = None, timeout_seconds: float = 600.0, config: CommConfig | None = None
) -> World:
    """Join the job started by hvdrun/torchrun (or form a world of one). Idempotent.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or ``None`` (NCCL when CUDA is available, else gloo).
        timeout_seconds: collective and rendezvous timeout, seconds.
        config: cross-rank checks, stall inspection and timeline (default: from the
            environment, e.g. ``HOROVOD_TIMELINE``).

    Returns:
        The :class:`World` (rank, size, local_rank, ..., device, backend).
    """
    return _comm_init(backend=backend, timeout_seconds=timeout_seconds, config=config)


def size() -> int:
    """Number of processes in the job. Raises NotInitializedError before init()."""
    return get_world().size


def rank() -> int:
    """Global rank of this process. Raises NotInitializedError before init()."""
    return get_world().rank


def local_size() -> int:
    """Number of processes on this node. Raises NotInitializedError before init()."""
    return get_world().local_size


def local_rank() -> int:
    """Rank of this process on its node. Raises NotInitializedError before init()."""
    return get_world().local_rank


def cross_size() -> int:
    """Number of nodes. Raises NotInitializedError before init()."""
    return get_world().cross_size


def cross_rank() -> int:
    """Index of this node. Raises NotInitializedError before init()."""
    return get_world().cross_rank


# Horovod-style torch API: optimizer wrapper, state broadcast, sparse reduce, SyncBatchNorm.
from hvd_trainer.optimizer import (  # noqa: E402
    DistributedOptimizer,
    GradientSyncError,
    OptimizerConfigError,
)
from hvd_trainer.sparse import sparse_allreduce  # noqa: E402
from hvd_trainer.state_sync import broadcast_optimizer_state, broadcast_parameters  # noqa: E402
from hvd_trainer.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm  # noqa: E402

__all__ += [
    "DistributedOptimizer", "GradientSyncError", "OptimizerConfigError",
    "broadcast_parameters", "broadcast_optimizer_state", "sparse_allreduce",
    "SyncBatchNorm", "convert_sync_batchnorm",
]

from hvd_trainer import _register  # noqa: E402,F401  (registers strategy="horovod")

"""hvd_trainer's Horovod torch API: ``import hvd_trainer.torch as hvd`` reads like
``import horovod.torch as hvd`` (``import hvd_trainer as hvd`` offers the same names)::

    hvd.init()
    print(hvd.rank(), hvd.size())
    avg = hvd.allreduce(torch.ones(3))          # average over ranks
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hvd_trainer import elastic
from hvd_trainer.comm import (
    Adasum,
    Average,
    CollectiveMismatchError,
    CommConfig,
    Compression,
    Handle,
    HorovodInternalError,
    HostsUpdatedInterrupt,
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
    UnsupportedOpError,
    World,
    add_process_set,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    ccl_built,
    cuda_built,
    ddl_built,
    get_world,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    is_homogeneous,
    is_initialized,
    join,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    reducescatter,
    reducescatter_async,
    register_process_sets,
    remove_process_set,
    rocm_built,
    shutdown,
    start_timeline,
    stop_timeline,
    synchronize,
)
from hvd_trainer.comm import init as _comm_init
from hvd_trainer.comm.world import check_comm_arg as _check_comm_arg
from hvd_trainer.torch.optimizer import DistributedOptimizer, GradientSyncError, OptimizerConfigError
from hvd_trainer.torch.sparse import sparse_allreduce, sparse_allreduce_async
from hvd_trainer.torch.state_sync import broadcast_optimizer_state, broadcast_parameters
from hvd_trainer.torch.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = [
    "init", "shutdown", "is_initialized", "get_world", "World",
    "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "poll", "synchronize", "Handle",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "allgather", "broadcast", "broadcast_", "alltoall", "reducescatter", "barrier", "join",
    "broadcast_object", "allgather_object", "ProcessSet", "Compression",
    "Average", "Sum", "Min", "Max", "Product", "ReduceOp",
    "CollectiveMismatchError", "NotInitializedError", "StallError", "JoinedRankError",
    # the rest of horovod.torch's names
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "start_timeline", "stop_timeline",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast_async",
    "broadcast_async_", "alltoall_async", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "Adasum", "UnsupportedOpError",
    "add_process_set", "remove_process_set", "global_process_set",
    "HorovodInternalError", "HostsUpdatedInterrupt", "elastic",
    "RankFailedError",
    # the torch API: optimizer wrapper, state broadcast, sparse reduce, SyncBatchNorm
    "DistributedOptimizer", "GradientSyncError", "OptimizerConfigError",
    "broadcast_parameters", "broadcast_optimizer_state", "sparse_allreduce",
    "sparse_allreduce_async", "SyncBatchNorm", "convert_sync_batchnorm",
]


def init(
    comm: Any = None,
    process_sets: Sequence[ProcessSet] | str | None = None,
    *,
    backend: str | None = None,
    timeout_seconds: float = 600.0,
    config: CommConfig | None = None,
) -> World:
    """Join the job started by hvdrun/torchrun (or form a world of one). Idempotent.

    ``init(comm=None, process_sets=None)`` is Horovod's signature; the rest is ours.

    Args:
        comm: ``None``, or (Horovod) all launched ranks as a list or an mpi4py communicator
            of the job's size; a subset is rejected (see ``comm.world.check_comm_arg``).
        process_sets: ``ProcessSet`` objects built before ``init()`` to create now, in order,
            on every rank; or ``"dynamic"`` / ``None`` (sets can always be added later with
            :func:`add_process_set`).
        backend: ``"nccl"``, ``"gloo"`` or ``None``: NCCL when every process on this node can
            have its own GPU, else gloo on the CPU (with a warning when there are GPUs, but
            fewer than the node's processes).
        timeout_seconds: collective and rendezvous timeout, seconds.
        config: cross-rank checks, stall inspection and timeline (default: from the
            environment, e.g. ``HOROVOD_TIMELINE``).

    Returns:
        The :class:`World` (rank, size, local_rank, ..., device, backend).

    Raises:
        CommValueError: ``comm`` is a subset of the job; duplicate ``process_sets``.
        CommTypeError: ``comm`` or a ``process_sets`` entry has the wrong type.
    """
    _check_comm_arg(comm)
    world = _comm_init(backend=backend, timeout_seconds=timeout_seconds, config=config)
    register_process_sets(process_sets, world=world)
    return world


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

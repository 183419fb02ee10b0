"""hvd_trainer's Horovod torch API: ``import hvd_trainer.torch as hvd`` reads like
``import horovod.torch as hvd`` (``import hvd_trainer as hvd`` offers the same names)::

    hvd.init()
    print(hvd.rank(), hvd.size())
    avg = hvd.allreduce(torch.ones(3))          # average over ranks
"""

from __future__ import annotations

from hvd_trainer.comm import (
    Adasum,
    Average,
    CollectiveMismatchError,
    Compression,
    DuplicateNameError,
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
    cross_rank,
    cross_size,
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
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    synchronize,
)
from hvd_trainer.launch.run_fn import run  # horovod.run: fn on N local processes
from hvd_trainer.torch import compression, functions, mpi_ops
from hvd_trainer.torch import elastic as _elastic_module_path  # noqa: F401 - Horovod's path
from hvd_trainer.torch.local_sgd import LocalSGD, LocalSGDConfigError
from hvd_trainer.torch.optimizer import DistributedOptimizer, GradientSyncError, OptimizerConfigError
from hvd_trainer.torch.sparse import sparse_allreduce, sparse_allreduce_async
from hvd_trainer.torch.state_sync import broadcast_optimizer_state, broadcast_parameters
from hvd_trainer.torch.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

# ``hvd.elastic`` is the hvd_trainer.elastic package (so ``import hvd_trainer as hvd``, which
# star-imports this module, keeps it); ``import hvd_trainer.torch.elastic`` gives the module
# of Horovod's path, which re-exports the same names.
# isort: split
from hvd_trainer import elastic

__all__ = [
    "run",
    "init", "shutdown", "is_initialized", "get_world", "World",
    "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "poll", "synchronize", "Handle",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "broadcast", "broadcast_", "alltoall", "reducescatter", "barrier", "join",
    "broadcast_object", "allgather_object", "ProcessSet", "Compression",
    "Average", "Sum", "Min", "Max", "Product", "ReduceOp",
    "CollectiveMismatchError", "NotInitializedError", "StallError", "JoinedRankError",
    "DuplicateNameError",
    # the rest of horovod.torch's names
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "start_timeline", "stop_timeline",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast_async",
    "broadcast_async_", "alltoall_async", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "Adasum", "UnsupportedOpError",
    "add_process_set", "remove_process_set", "global_process_set",
    "HorovodInternalError", "HostsUpdatedInterrupt", "elastic", "mpi_ops", "compression", "functions",
    "RankFailedError",
    # the torch API: optimizer wrapper, state broadcast, sparse reduce, SyncBatchNorm
    "DistributedOptimizer", "GradientSyncError", "OptimizerConfigError",
    "broadcast_parameters", "broadcast_optimizer_state", "sparse_allreduce",
    "sparse_allreduce_async", "SyncBatchNorm", "convert_sync_batchnorm",
    # slow links: DiLoCo-style local steps
    "LocalSGD", "LocalSGDConfigError",
]


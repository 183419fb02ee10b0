"""hvd_trainer's comm layer: process-group bootstrap, collectives, gradient fusion, cross-rank
checks, compression, process sets and the timeline.

Knows nothing of Lightning or Keras; every upper layer sits on it.
"""

from __future__ import annotations

from hvd_trainer.comm.collectives import (
    Handle,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    poll,
    synchronize,
)
from hvd_trainer.comm.compression import Compression, Compressor
from hvd_trainer.comm.config import CommConfig, default_fusion_threshold_bytes
from hvd_trainer.comm.errors import (
    CollectiveMismatchError,
    CommError,
    CommTypeError,
    CommValueError,
    JoinedRankError,
    NotInitializedError,
    RankFailedError,
    StallError,
)
from hvd_trainer.comm.fusion import FusionConfig, GradientReducer
from hvd_trainer.comm.movement import (
    allgather,
    allgather_object,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    join,
    reducescatter,
)
from hvd_trainer.comm.ops import Average, Max, Min, Product, ReduceOp, Sum, to_reduce_op
from hvd_trainer.comm.process_set import ProcessSet
from hvd_trainer.comm.timeline import Timeline
from hvd_trainer.comm.world import (
    LaunchEnv,
    World,
    detect_launch_env,
    free_port,
    get_world,
    init,
    is_initialized,
    shutdown,
)

__all__ = [
    "Average", "Sum", "Min", "Max", "Product", "ReduceOp", "to_reduce_op",
    "World", "LaunchEnv", "detect_launch_env", "init", "shutdown", "is_initialized",
    "get_world", "free_port", "CommConfig",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "Handle", "poll", "synchronize",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "allgather", "broadcast", "broadcast_", "alltoall", "reducescatter", "barrier", "join",
    "broadcast_object", "allgather_object",
    "ProcessSet", "Compression", "Compressor", "Timeline",
    "FusionConfig", "GradientReducer", "default_fusion_threshold_bytes",
    "CommError", "CommValueError", "CommTypeError", "NotInitializedError",
    "CollectiveMismatchError", "StallError", "JoinedRankError", "RankFailedError",
]

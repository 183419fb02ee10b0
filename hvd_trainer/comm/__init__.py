"""hvd_trainer's comm layer: process-group bootstrap, collectives and gradient fusion.

Knows nothing of Lightning or Keras; every upper layer sits on it.
"""

from __future__ import annotations

from hvd_trainer.comm.collectives import (
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
)
from hvd_trainer.comm.errors import CollectiveMismatchError, CommError, NotInitializedError
from hvd_trainer.comm.fusion import FusionConfig, GradientReducer
from hvd_trainer.comm.ops import Average, Max, Min, Product, ReduceOp, Sum, to_reduce_op
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
    "get_world", "free_port",
    "allreduce", "allreduce_", "allgather", "broadcast", "broadcast_", "barrier",
    "broadcast_object", "allgather_object",
    "FusionConfig", "GradientReducer",
    "CommError", "NotInitializedError", "CollectiveMismatchError",
]

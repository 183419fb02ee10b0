"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, arXiv:1910.02054) on the fused buckets.

Each trainable parameter is owned by one rank (:mod:`~hvd_trainer.comm.zero.plan`: balanced by
bytes, planned bucket by bucket so a bucket's reduce-scatter hands each rank its parameters'
gradients); with a per-element optimizer (Adam, SGD, ...) the plan is by elements instead, a
parameter possibly cut into pieces of different owners (:mod:`~hvd_trainer.comm.zero.pieces`),
so every rank holds ``1/N`` of the state (and in stage 2 of the gradients) whatever the model.
Stage 1 shards the optimizer state: gradients are allreduced as without ZeRO, each rank steps
only what it owns, and the updated parameters are exchanged
(:mod:`~hvd_trainer.comm.zero.sharding`). Stage 2 also shards the averaged gradients: the buckets
are reduce-scattered (:mod:`~hvd_trainer.comm.zero.reducer`), so after backward a rank holds
only its own parameters' gradients.

Rows (each imports only the rows below it): ``sharding`` → ``reducer``, ``pieces`` →
``collectives`` → ``plan``, ``stage`` (the ``zero_stage`` argument check every front end shares).
"""

from __future__ import annotations

from hvd_trainer.comm.zero.collectives import exchange_parameters, start_reducescatter
from hvd_trainer.comm.zero.pieces import PER_ELEMENT, ZeroLayoutError, per_element
from hvd_trainer.comm.zero.plan import BucketShard, ShardPlan, plan_shards
from hvd_trainer.comm.zero.reducer import ShardedGradientReducer, plan_parameters
from hvd_trainer.comm.zero.sharding import (
    NOT_PER_PARAMETER,
    PER_PARAMETER,
    UnshardableOptimizerError,
    ZeroSharding,
    check_per_parameter,
    state_bytes,
)
from hvd_trainer.comm.zero.stage import ZERO_STAGES, check_overlap_arg, check_zero_stage

__all__ = [
    "BucketShard", "ShardPlan", "plan_shards", "plan_parameters",
    "start_reducescatter", "exchange_parameters", "ShardedGradientReducer",
    "ZeroSharding", "UnshardableOptimizerError", "check_per_parameter", "state_bytes",
    "PER_PARAMETER", "NOT_PER_PARAMETER", "ZERO_STAGES", "check_overlap_arg", "check_zero_stage",
    "PER_ELEMENT", "per_element", "ZeroLayoutError",
]

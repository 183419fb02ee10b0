"""hvd_trainer's comm layer: process-group bootstrap, collectives, gradient fusion, cross-rank
checks, compression, process sets and the timeline.

Knows nothing of Lightning or Keras; every upper layer sits on it. Five sub-packages are its
layers, bottom to top ``base < world < ops < reduce < zero``, with ``session``, ``gradient_sync``,
``runtime`` and ``sync_options`` on top; a module never imports one of a higher sub-package. Inside, every
import points down: a module imports only modules of the rows below its own (no cycle, and no
import inside a function except the optional ``mpi4py``; ``tests/unit/test_layering.py`` keeps both so)::

    session                init / shutdown, Horovod's init(comm, process_sets); recover (in-process)
    gradient_sync          the gradient reduction every front end drives: reducer, "auto", feedback state
    runtime                per-world state: config, store, timeline, the live process sets
    sync_options           every front end's gradient-sync options, checked in one place
  zero/                    ZeRO stages 1 and 2 (imported as hvd_trainer.comm.zero, not re-exported)
    sharding               owned-parameter step, parameter exchange, state consolidation, clipping
    reducer  pieces        stage 2's reduce-scattering bucket reducer (a GradientReducer);
                           parameters cut by elements between ranks, the optimizer seen through them
    collectives            a bucket's reduce-scatter; the exchange of updated parameters
    plan  stage            which rank owns which parameter or piece (balanced over the buckets);
                           stage: the zero_stage argument check of every front end
  reduce/                  gradient reduction over fused buckets
    fusion                 the gradient reducer (hook-driven buckets)
    bucket_hooks           the one seam of bucket algorithms: hook(state, bucket) -> future
    hierarchical/          inside each host, then across hosts (HOROVOD_HIERARCHICAL_ALLREDUCE)
    autotune  link_probe   the search of the bucket layout; the measured link and its bucket cap
    compressed/            int8 blocks and PowerSGD with error feedback, as bucket reductions
    localsgd/              DiLoCo local steps: the outer step on the averaged parameter change
  ops/                     the collectives, from their arguments to the blocking forms
    objects                broadcast_object, allgather_object
    collectives            the blocking forms: the async forms + wait(); join
    autograd               differentiable allreduce / allgather / broadcast, on the async forms
    by_name                named *_async calls matched by name (Horovod's negotiation): the public async forms
    reductions_async  movement_async   the async forms
    handle  reduce  adasum Handle / poll / synchronize; the one allreduce path; Adasum
    process_set_registry   add / remove / register process sets
    process_set            ProcessSet (holds its rank, ranks and coordinator, not the World)
    checks                 cross-rank signature checks, stall inspection
    timeline  optimizer_args   (optimizer_args: the checks both DistributedOptimizers share)
    flatten  ops  arguments  compression
  world/                   who takes part and whether they are still there
    build_info             Horovod's *_built / *_enabled queries
    world  liveness  heartbeat  membership  join_board  quorum
                           (heartbeat: partitions; membership: the job secret;
                            quorum: who trains after a loss, for in-process recovery)
  base/                    imports nothing of the layers above
    store  config  launch_env  errors  fatal  future_work
    _torch_compat          the torch internals comm relies on (one place; tests/unit/test_compat.py)
"""

from __future__ import annotations

# The front ends' door: what torch/, keras/, strategy.py, lightning/, elastic/, launch/ and the
# package's other modules use of comm beyond the user API above. They import comm only from here
# (tests/unit/test_layering.py); these names are not in __all__ (not Horovod's API).
from hvd_trainer.comm.base._torch_compat import BatchNormBase, init_optimizer_bookkeeping
from hvd_trainer.comm.base.config import REDUCESCATTER_GRAD_ENV, CommConfig, default_fusion_threshold_bytes
from hvd_trainer.comm.base.errors import (
    CollectiveMismatchError,
    CommError,
    CommTypeError,
    CommValueError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    HostUnreachableError,
    JobSecretError,
    JoinedRankError,
    NotInitializedError,
    RankFailedError,
    StallError,
)
from hvd_trainer.comm.base.fatal import PEER_FAILED_EXIT_CODE, peer_failed, pid_alive
from hvd_trainer.comm.base.launch_env import (
    TorchElasticEnv,
    lightning_script_view,
    recovery_env,
    torchelastic_env,
    worker_launcher,
)
from hvd_trainer.comm.gradient_sync import ONE_BUCKET, GradientSync, ReducerSet
from hvd_trainer.comm.ops.by_name import (  # the public async forms: named calls match by name
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    reducescatter_async,
)
from hvd_trainer.comm.ops.checks import DuplicateNameError
from hvd_trainer.comm.ops.collectives import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    join,
    reducescatter,
)
from hvd_trainer.comm.ops.compression import (
    BF16Compressor,
    Compression,
    CompressionError,
    Compressor,
    FP16Compressor,
    NoneCompressor,
)
from hvd_trainer.comm.ops.flatten import flat_collective, flat_collective_, numpy_to_wire, wire_to_numpy
from hvd_trainer.comm.ops.handle import Handle, poll, synchronize
from hvd_trainer.comm.ops.objects import allgather_object, broadcast_object
from hvd_trainer.comm.ops.ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    UnsupportedOpError,
    op_or_average,
    reject_adasum,
    to_reduce_op,
)
from hvd_trainer.comm.ops.optimizer_args import OptimizerArgumentError, check_backward_passes_per_step
from hvd_trainer.comm.ops.process_set import ProcessSet, global_process_set, resolve_set
from hvd_trainer.comm.ops.process_set_registry import (
    HorovodBasics,
    add_process_set,
    process_set_ranks,
    register_process_sets,
    remove_process_set,
)
from hvd_trainer.comm.ops.timeline import Timeline, start_timeline, stop_timeline
from hvd_trainer.comm.reduce.auto import AutoChoice, AutoMode
from hvd_trainer.comm.reduce.autotune import AutotuneConfig, resolve_autotune
from hvd_trainer.comm.reduce.compressed import (
    FeedbackState,
    merge_feedback,
    reduce_with_feedback,
    rename_feedback,
)
from hvd_trainer.comm.reduce.fusion import FusionConfig, GradientReducer
from hvd_trainer.comm.reduce.localsgd import LocalSGDConfig, LocalSGDConfigError, OuterArgs, OuterSync
from hvd_trainer.comm.session import (
    finish_job,
    first_survivor,
    in_process_recovery,
    init,
    recover,
    reform_due,
    shutdown,
)
from hvd_trainer.comm.sync_options import SyncOptions, local_steps_config
from hvd_trainer.comm.world.build_info import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    mpi4py_installed,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    nccl_version,
    rocm_built,
)
from hvd_trainer.comm.world.heartbeat import UNREACHABLE_RECORD, read_records
from hvd_trainer.comm.world.liveness import raise_if_peer_failed
from hvd_trainer.comm.world.membership import SECRET_ENV
from hvd_trainer.comm.world.quorum import gone_key
from hvd_trainer.comm.world.world import (
    LaunchEnv,
    World,
    cross_rank,
    cross_size,
    detect_launch_env,
    free_port,
    get_world,
    is_initialized,
    local_rank,
    local_size,
    rank,
    size,
)
from hvd_trainer.comm.zero import (
    ShardedGradientReducer,
    ShardPlan,
    ZeroSharding,
    exchange_parameters,
    per_element,
    plan_parameters,
)
from hvd_trainer.comm.zero.reducer import stage2_config

__all__ = [
    "Average", "Sum", "Min", "Max", "Product", "ReduceOp", "to_reduce_op", "reject_adasum",
    "World", "LaunchEnv", "detect_launch_env", "init", "shutdown", "is_initialized",
    "get_world", "free_port", "CommConfig", "recover", "reform_due", "in_process_recovery", "finish_job",
    "first_survivor",
    "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "Handle", "poll", "synchronize",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "broadcast", "broadcast_", "alltoall", "reducescatter", "barrier", "join",
    "broadcast_object", "allgather_object",
    "ProcessSet", "Compression", "Compressor", "Timeline",
    "FusionConfig", "GradientReducer", "AutotuneConfig", "default_fusion_threshold_bytes",
    "CommError", "CommValueError", "CommTypeError", "NotInitializedError",
    "CollectiveMismatchError", "StallError", "JoinedRankError", "RankFailedError", "DuplicateNameError",
    "HostUnreachableError", "JobSecretError",
    # Horovod-compatible names (build info, timeline control, async/grouped forms, registry)
    "Adasum", "UnsupportedOpError", "HorovodInternalError", "HostsUpdatedInterrupt",
    "gloo_built", "nccl_built", "mpi_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
    "mpi_enabled", "gloo_enabled", "mpi_threads_supported", "is_homogeneous",
    "start_timeline", "stop_timeline",
    "allgather_async", "broadcast_async", "broadcast_async_", "alltoall_async", "reducescatter_async",
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
    "grouped_reducescatter_async",
    "global_process_set", "add_process_set", "remove_process_set", "register_process_sets",
    "process_set_ranks", "HorovodBasics",
]

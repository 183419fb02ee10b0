"""Bootstrap of the process group and the one explicit :class:`World` object.

``init()`` reads what launched this process (torchrun today; MPI and Slurm are read in the same
function, :func:`detect_launch_env`), initialises ``torch.distributed`` with NCCL when CUDA is
available and gloo otherwise, and returns a frozen :class:`World`. Library code receives the
``World`` (or its ``group``) as an argument; the module-level functions in ``hvd_trainer``
read the one returned by :func:`get_world`.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import socket
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hvd_trainer.comm.errors import CommTypeError, CommValueError, NotInitializedError
from hvd_trainer.comm.launch_env import LaunchEnv, from_mpi, from_slurm, from_torchrun

if TYPE_CHECKING:
    from hvd_trainer.comm.config import CommConfig

__all__ = [
    "LaunchEnv",
    "World",
    "detect_launch_env",
    "init",
    "shutdown",
    "is_initialized",
    "get_world",
    "check_comm_arg",
]

DEFAULT_TIMEOUT_SECONDS = 600.0


@dataclass(frozen=True, slots=True)
class World:
    """The processes of one job and this process's place in it.

    Attributes:
        rank: global rank in ``[0, size)``.
        size: number of processes (world size).
        local_rank: rank among the processes on this node.
        local_size: number of processes on this node.
        cross_rank: index of this node (``rank // local_size`` for homogeneous jobs).
        cross_size: number of nodes.
        device: the device this rank computes on (``cuda:local_rank`` or ``cpu``).
        backend: ``"nccl"`` or ``"gloo"``.
        group: the global ``torch.distributed`` process group.
        cpu_group: a group for CPU tensors and objects (the global group on gloo; a gloo side
            group when the global backend is NCCL, so CPU tensors never hit NCCL).
        runtime: the comm layer's state for this world (``CommRuntime``: config, key-value
            store, timeline, global process set); ``None`` for a hand-made ``World``.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    device: torch.device
    backend: str
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    runtime: Any = None

    def group_for(self, tensor: torch.Tensor) -> dist.ProcessGroup | None:
        """The process group that can carry ``tensor`` (CPU tensors use ``cpu_group``)."""
        if tensor.device.type == "cpu":
            return self.cpu_group
        return self.group


_WORLD: World | None = None


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's variables. The only place that reads launch environment variables.

    Recognised, first match wins: torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); Open MPI (``OMPI_COMM_WORLD_*``)
    or MPICH/PMI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``), with
    the rendezvous address from ``MASTER_ADDR``/``MASTER_PORT``, else mpi4py, else loopback on
    one node; Slurm ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, first host
    of the node list, port ``10000 + SLURM_JOB_ID % 50000``); otherwise a world of one.
    Details per launcher: :mod:`hvd_trainer.comm.launch_env`.

    Raises:
        ValueError: a variable is present but not an integer, ranks are out of range, or an
            MPI job on several nodes has no way to agree on a rendezvous address.
    """
    env = os.environ if environ is None else environ
    info = from_torchrun(env) or from_mpi(env) or from_slurm(env)
    if info is None:
        info = LaunchEnv(rank=0, size=1, local_rank=0, local_size=1)
    _validate(info)
    return info


def _validate(info: LaunchEnv) -> None:
    if info.size < 1 or not 0 <= info.rank < info.size:
        raise ValueError(
            f"launcher reported rank={info.rank} world size={info.size}; expected 0 <= rank < size. "
            "HINT: check RANK/WORLD_SIZE in the environment."
        )
    if not 0 <= info.local_rank < info.local_size:
        raise ValueError(
            f"launcher reported local_rank={info.local_rank} local_size={info.local_size}; "
            "expected 0 <= local_rank < local_size."
        )


def _default_backend(local_size: int) -> str:
    """NCCL when every local process can have its own GPU, else gloo (CPU), with a warning
    when GPUs exist but are fewer than the local processes (a CPU job on a GPU host)."""
    if not torch.cuda.is_available():
        return "gloo"
    count = torch.cuda.device_count()
    if local_size <= count:
        return "nccl"
    warnings.warn(
        f"{local_size} processes on this node but {count} GPU(s): hvd_trainer uses gloo on the CPU. "
        "HINT: start at most one process per GPU (hvdrun -np <number of GPUs>) to train on the "
        "GPUs, or pass init(backend='gloo') to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )
    return "gloo"


def _pick_device(
    local_rank: int, backend: str | None, local_size: int = 1
) -> tuple[torch.device, str]:
    if backend is None:
        backend = _default_backend(local_size)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs CUDA, but torch.cuda.is_available() is False.")
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(
                f"local_rank {local_rank} has no GPU: this node has {count} CUDA device(s). "
                "HINT: start at most one process per GPU (hvdrun -np <number of GPUs>)."
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device, backend
    return torch.device("cpu"), backend


def _world_from_group(info: LaunchEnv, device: torch.device, backend: str) -> World:
    local_size = info.local_size
    cross_size = max(1, info.size // local_size) if info.size % local_size == 0 else -1
    if cross_size == -1:
        cross_size = (info.size + local_size - 1) // local_size
    return World(
        rank=info.rank,
        size=info.size,
        local_rank=info.local_rank,
        local_size=local_size,
        cross_rank=info.rank // local_size,
        cross_size=cross_size,
        device=device,
        backend=backend,
        group=dist.group.WORLD,
        cpu_group=dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo"),
    )


def init(
    *,
    backend: str | None = None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    environ: Mapping[str, str] | None = None,
    config: CommConfig | None = None,
) -> World:
    """Initialise the global process group once and return the :class:`World`.

    Idempotent: a second call returns the existing world. If ``torch.distributed`` was already
    initialised by someone else (e.g. Lightning), that group is adopted.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or ``None``: NCCL when every process on this node can
            have its own GPU, else gloo on the CPU (with a warning when there are GPUs, but
            fewer than the node's processes).
        timeout_seconds: timeout of the process group's collectives and rendezvous, seconds.
        environ: environment to read instead of ``os.environ`` (tests).
        config: checks, stall inspection and timeline settings (default:
            ``CommConfig.from_env()``, which reads ``HOROVOD_TIMELINE`` and the stall variables).

    Raises:
        ValueError: inconsistent launcher variables, or NCCL requested without a GPU.
    """
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    info = detect_launch_env(environ)
    device, backend = _pick_device(info.local_rank, backend, info.local_size)
    timeout = timedelta(seconds=timeout_seconds)
    if not dist.is_initialized():
        if info.size == 1 and info.master_addr is None:
            # A world of one needs no rendezvous: an in-process store keeps every collective
            # available (and identical in behaviour) without opening a port.
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            os.environ.setdefault("MASTER_ADDR", info.master_addr or "127.0.0.1")
            if info.master_port is not None:
                os.environ.setdefault("MASTER_PORT", str(info.master_port))
            dist.init_process_group(
                backend, store=_generation_store(info, timeout), rank=info.rank,
                world_size=info.size, timeout=timeout,
            )
    else:
        backend = dist.get_backend()
        info = LaunchEnv(
            rank=dist.get_rank(),
            size=dist.get_world_size(),
            local_rank=info.local_rank,
            local_size=info.local_size,
            launcher=info.launcher,
        )
    from hvd_trainer.comm.config import CommConfig
    from hvd_trainer.comm.runtime import CommRuntime

    runtime = CommRuntime(config or CommConfig.from_env(environ), info.rank)
    _WORLD = replace(_world_from_group(info, device, backend), runtime=runtime)
    runtime.attach(_WORLD)
    _shutdown_at_exit()
    if _WORLD.size > 1 and runtime.store is not None:
        from hvd_trainer.comm.fatal import flush_before_hard_exit
        from hvd_trainer.comm.liveness import mark_exited

        store, rank = runtime.store, _WORLD.rank
        flush_before_hard_exit(lambda: mark_exited(store, rank))  # a hard exit skips shutdown()
    return _WORLD


_GENERATION = 0


def _generation_store(info: LaunchEnv, timeout: timedelta) -> dist.Store:
    """The job's store (``env://`` rendezvous) under a prefix unique to this ``init`` call.

    A launcher's store (torchrun's agent) outlives ``shutdown()``: without a fresh prefix a
    second ``init()`` in the same job would find the first process group's keys there and
    connect to its closed gloo addresses (or read stale cross-rank check entries). Every rank
    calls ``init``/``shutdown`` the same number of times, so the prefixes agree.
    """
    global _GENERATION
    _GENERATION += 1
    store, _, _ = next(dist.rendezvous("env://", rank=info.rank, world_size=info.size, timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"hvd_trainer/{_GENERATION}", store)


def is_initialized() -> bool:
    """Whether :func:`init` has run (and :func:`shutdown` has not)."""
    return _WORLD is not None


def get_world() -> World:
    """Return the initialised :class:`World`.

    Raises:
        NotInitializedError: :func:`init` has not been called.
    """
    if _WORLD is None:
        raise NotInitializedError()
    return _WORLD


def shutdown() -> None:
    """Destroy the process group. Safe to call twice; ``init()`` may be called again after.

    Also registered to run at interpreter exit (as Horovod does), so scripts need not call it.
    After it, the :class:`World` and process sets a script still holds no longer reference any
    process group: a gloo group that outlives ``destroy_process_group`` is destroyed during
    interpreter finalisation instead, where its worker threads sometimes abort the process
    ("terminate called without an active exception", exit status 134) after a successful run.
    """
    global _WORLD
    world = _WORLD
    if world is not None and world.runtime is not None:
        if world.size > 1 and world.runtime.store is not None:
            from hvd_trainer.comm.liveness import mark_exited

            mark_exited(world.runtime.store, world.rank)  # peers still waiting can name us
        world.runtime.close()  # releases every process set's groups
    if world is not None:
        # World is frozen for users; releasing its group handles is the one mutation.
        object.__setattr__(world, "group", None)
        object.__setattr__(world, "cpu_group", None)
    _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # groups kept alive only by reference cycles go now, not at finalisation


@functools.cache
def _shutdown_at_exit() -> None:
    """Register :func:`shutdown` to run at interpreter exit, once per process."""
    atexit.register(shutdown)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now (bound then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_comm_arg(comm: Any, environ: Mapping[str, str] | None = None) -> None:
    """Accept Horovod's ``init(comm=...)`` when it means "every launched process".

    hvd_trainer's world is always every process the launcher started. ``comm`` may be
    ``None``, the list of all ranks (``[0, ..., size-1]``, any order) or an mpi4py communicator
    of that size (e.g. ``MPI.COMM_WORLD``); anything smaller is rejected rather than silently
    ignored.

    Raises:
        CommValueError: ``comm`` names a subset of the launched processes.
        CommTypeError: ``comm`` is neither a list of ranks nor a communicator.
    """
    if comm is None:
        return
    size = detect_launch_env(environ).size
    if hasattr(comm, "Get_size"):
        asked, what = int(comm.Get_size()), f"a communicator of size {comm.Get_size()}"
        ok = asked == size
    elif isinstance(comm, list | tuple | range):
        ranks = sorted(int(r) for r in comm)
        ok, what = ranks == list(range(size)), f"ranks {ranks}"
    else:
        raise CommTypeError(
            f"init(comm={comm!r}): expected a list of ranks or an mpi4py communicator, got "
            f"{type(comm).__name__}. HINT: call hvd.init() without comm."
        )
    if not ok:
        raise CommValueError(
            f"init(comm=...) asked for {what}, but hvd_trainer's world is all {size} launched "
            "processes. HINT: launch only the processes you need (hvdrun -np N), or keep them "
            "all and run the subset's collectives on hvd.ProcessSet(ranks)."
        )

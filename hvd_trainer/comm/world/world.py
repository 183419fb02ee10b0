"""The one explicit :class:`World` object, the slot holding the current one, and what launched us.

:func:`~hvd_trainer.comm.session.init` builds the :class:`World` and puts it in the slot
(:func:`set_current`); :func:`~hvd_trainer.comm.session.shutdown` empties it. Library code
receives the ``World`` (or its ``group``) as an argument; the Horovod-style queries here
(:func:`size`, :func:`rank`, ...) and the module-level functions in ``hvd_trainer`` read the one
returned by :func:`get_world`. :func:`detect_launch_env` is the one reader of the launcher's
variables.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hvd_trainer.comm.base.errors import NotInitializedError
from hvd_trainer.comm.base.launch_env import LaunchEnv, from_horovod, from_mpi, from_slurm, from_torchrun

__all__ = [
    "LaunchEnv",
    "World",
    "detect_launch_env",
    "is_initialized",
    "get_world",
    "set_current",
    "free_port",
    "size",
    "rank",
    "local_size",
    "local_rank",
    "cross_size",
    "cross_rank",
]


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
"""The initialised world (``None`` before ``init()`` and after ``shutdown()``)."""


def set_current(world: World | None) -> None:
    """Make ``world`` the one :func:`get_world` returns (``None``: not initialised).

    Called only by :func:`~hvd_trainer.comm.session.init` and
    :func:`~hvd_trainer.comm.session.shutdown`.
    """
    global _WORLD
    _WORLD = world


def _current() -> World | None:
    """The current world, or ``None``; a world whose process group was destroyed behind our
    back (``torch.distributed.destroy_process_group()``, which Lightning's teardown calls) is
    released first, so the next ``init()`` builds a new one on whatever group exists then."""
    global _WORLD
    world = _WORLD
    if world is None or world.group is None:
        return world
    if dist.is_initialized() and dist.group.WORLD is world.group:
        return world
    _WORLD = None
    close = getattr(world.runtime, "close", None)
    if close is not None:
        close()  # flush its timeline, drop its process sets' group handles
    object.__setattr__(world, "group", None)  # frozen for users; releasing is the one mutation
    object.__setattr__(world, "cpu_group", None)
    return None


def is_initialized() -> bool:
    """Whether :func:`~hvd_trainer.comm.session.init` has run (and neither ``shutdown`` nor
    ``torch.distributed.destroy_process_group`` has run since)."""
    return _current() is not None


def get_world() -> World:
    """Return the initialised :class:`World`.

    Raises:
        NotInitializedError: ``init()`` has not been called, or the process group it used was
            destroyed since (call ``init()`` again).
    """
    world = _current()
    if world is None:
        raise NotInitializedError()
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


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's variables. The only place that reads launch environment variables.

    Recognised, first match wins: torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); horovodrun (``HOROVOD_RANK``,
    ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``); Open MPI (``OMPI_COMM_WORLD_*``)
    or MPICH/PMI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``), with
    the rendezvous address from ``MASTER_ADDR``/``MASTER_PORT``, else mpi4py, else loopback on
    one node; Slurm ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, first host
    of the node list, port ``15000 + SLURM_JOB_ID % 10000``); otherwise a world of one.
    Details per launcher: :mod:`hvd_trainer.comm.base.launch_env`.

    Raises:
        ValueError: a variable is present but not an integer, ranks are out of range, or an
            MPI job on several nodes has no way to agree on a rendezvous address.
    """
    env = os.environ if environ is None else environ
    info = from_torchrun(env) or from_horovod(env) or from_mpi(env) or from_slurm(env)
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


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now (bound then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])

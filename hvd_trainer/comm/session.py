"""Init and shutdown of the comm layer, in one place: Horovod's ``init(comm, process_sets)``.

:func:`init` reads what launched this process (:func:`~hvd_trainer.comm.world.world.detect_launch_env`),
initialises ``torch.distributed`` with NCCL when every local process can have its own GPU and
gloo otherwise, builds the frozen :class:`~hvd_trainer.comm.world.world.World` with its
:class:`~hvd_trainer.comm.runtime.CommRuntime` (config, store, timeline, process sets), publishes
this rank for dead-rank detection, creates the process sets passed to it and makes the world the
current one. :func:`shutdown` undoes all of it (and runs at interpreter exit).

This module is the top of the comm layer's bootstrap: it imports the world, the runtime, the
process-set registry and liveness; none of them imports it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hvd_trainer.comm.base.config import CommConfig
from hvd_trainer.comm.base.errors import CommTypeError, CommValueError, RankFailedError
from hvd_trainer.comm.base.fatal import flush_before_hard_exit, recovered
from hvd_trainer.comm.base.launch_env import LaunchEnv, recovery_env, torchelastic_env
from hvd_trainer.comm.base.store import generation_store, raw_job_store
from hvd_trainer.comm.ops.process_set import ProcessSet
from hvd_trainer.comm.ops.process_set_registry import register_process_sets
from hvd_trainer.comm.runtime import CommRuntime
from hvd_trainer.comm.world.liveness import mark_exited
from hvd_trainer.comm.world.quorum import JobFinished, Membership, Quorum
from hvd_trainer.comm.world.world import World, detect_launch_env, get_world, is_initialized, set_current

__all__ = ["init", "shutdown", "recover", "reform_due", "in_process_recovery", "finish_job", "check_comm_arg",
           "DEFAULT_TIMEOUT_SECONDS"]

DEFAULT_TIMEOUT_SECONDS = 600.0
"""Default timeout of the process group's collectives and rendezvous, seconds."""


def init(
    comm: Any = None,
    process_sets: Sequence[ProcessSet] | str | None = None,
    *,
    backend: str | None = None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    config: CommConfig | None = None,
    environ: Mapping[str, str] | None = None,
) -> World:
    """Join the job started by hvdrun/torchrun (or form a world of one) and return the World.

    ``init(comm=None, process_sets=None)`` is Horovod's signature; the keywords are ours.
    Idempotent: a second call returns the existing world (and still creates the
    ``process_sets`` it is given). If ``torch.distributed`` was already initialised by someone
    else (e.g. Lightning), that group is adopted.

    Args:
        comm: ``None``, or (Horovod) all launched ranks as a list or an mpi4py communicator
            of the job's size; a subset is rejected (see :func:`check_comm_arg`).
        process_sets: ``ProcessSet`` objects built before ``init()`` to create now, in order,
            on every rank; or ``"dynamic"`` / ``None`` (sets can always be added later with
            :func:`~hvd_trainer.comm.ops.process_set_registry.add_process_set`).
        backend: ``"nccl"``, ``"gloo"`` or ``None``: NCCL when every process on this node can
            have its own GPU, else gloo on the CPU (with a warning when there are GPUs, but
            fewer than the node's processes).
        timeout_seconds: timeout of the process group's collectives and rendezvous, seconds.
        config: checks, stall inspection and timeline settings (default:
            ``CommConfig.from_env()``, which reads ``HOROVOD_TIMELINE`` and the stall variables).
        environ: environment to read instead of ``os.environ`` (tests).

    Returns:
        The :class:`~hvd_trainer.comm.world.world.World` (rank, size, local_rank, ..., device, backend).

    Raises:
        ValueError: inconsistent launcher variables, or NCCL requested without a GPU.
        CommValueError: ``comm`` is a subset of the job; duplicate ``process_sets``.
        CommTypeError: ``comm`` or a ``process_sets`` entry has the wrong type.
    """
    check_comm_arg(comm, environ)
    world = _start_world(backend, timeout_seconds, environ, config)
    register_process_sets(process_sets, world=world)
    return world


def _start_world(
    backend: str | None,
    timeout_seconds: float,
    environ: Mapping[str, str] | None,
    config: CommConfig | None,
) -> World:
    """Initialise the global process group once and make its :class:`World` the current one."""
    if is_initialized():
        return get_world()
    info = detect_launch_env(environ)
    device, backend = _pick_device(info.local_rank, backend, info.local_size)
    timeout = timedelta(seconds=timeout_seconds)
    endpoint = (info.master_addr, info.master_port)  # the job's store, for the heartbeat
    if not dist.is_initialized() and _wants_quorum(info, environ):
        quorum = _make_quorum(info, timeout_seconds, environ)
        recovery = _Recovery(quorum, info, device, backend, timeout, endpoint,
                             config or CommConfig.from_env(environ))
        try:
            return recovery.build(quorum.join())
        except JobFinished:
            print(f"hvd_trainer: elastic: the job finished before this restarted worker (slot "
                  f"{quorum.slot}) could join; nothing left to do.", file=sys.stderr, flush=True)
            raise SystemExit(0) from None
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
                backend, store=generation_store(info.rank, info.size, timeout), rank=info.rank,
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
    runtime = CommRuntime(config or CommConfig.from_env(environ), info.rank)
    world = replace(_world_from_group(info, device, backend), runtime=runtime)
    set_current(world)
    runtime.attach(world, endpoint)
    _shutdown_at_exit()
    return world


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
        cross_rank=info.rank // local_size if info.cross_rank is None else info.cross_rank,
        cross_size=cross_size if info.cross_size is None else info.cross_size,
        device=device,
        backend=backend,
        group=dist.group.WORLD,
        cpu_group=dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo"),
    )


class _Recovery:
    """What in-process recovery needs to build each membership's world (one per process)."""

    current: _Recovery | None = None

    def __init__(self, quorum: Quorum, launch: LaunchEnv, device: torch.device, backend: str,
                 timeout: timedelta, endpoint: tuple[str | None, int | None], config: CommConfig) -> None:
        self.quorum, self.launch, self.device, self.backend = quorum, launch, device, backend
        self.timeout, self.endpoint, self.config = timeout, endpoint, config
        _Recovery.current = self

    def build(self, membership: Membership) -> World:
        """The process group and :class:`World` of ``membership`` (this process's rank in it is
        its slot's place; its local rank its place among the members on its host)."""
        rank = membership.rank_of(self.quorum.slot)
        me = membership.members[rank]
        local = [m.slot for m in membership.members if m.host == me.host]
        hosts = membership.hosts()
        store = dist.PrefixStore(f"hvd_trainer/q{membership.epoch}", self.quorum.store)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=membership.size,
                                timeout=self.timeout)
        info = replace(self.launch, rank=rank, size=membership.size, local_rank=local.index(me.slot),
                       local_size=len(local), cross_rank=hosts.index(me.host), cross_size=len(hosts))
        runtime = CommRuntime(self.config, rank, namespace=f"q{membership.epoch}")
        world = replace(_world_from_group(info, self.device, self.backend), runtime=runtime)
        set_current(world)
        runtime.attach(world, self.endpoint)
        _shutdown_at_exit()
        return world


def in_process_recovery() -> bool:
    """Whether this process's world was formed for in-process recovery (``hvdrun --recovery
    in-process``): :func:`recover` can then replace a broken world without a restart."""
    return _Recovery.current is not None and is_initialized()


def recover() -> World:
    """Replace a broken world in this process: drop its process group, agree with the other
    survivors (and any restarted worker waiting to join) on the next membership through the
    job's store (:class:`~hvd_trainer.comm.world.quorum.Quorum`), build its group and make it
    the current world. Called by ``hvd_trainer.elastic.run`` after a peer's failure
    (``RankFailedError``) or a scheduled reform (``HostsUpdatedInterrupt``).

    Returns:
        The new :class:`World` (ranks renumbered; size may differ).

    Raises:
        RuntimeError: the world was not formed for in-process recovery (see
            :func:`in_process_recovery`).
        RankFailedError: fewer than ``--min-np`` workers arrived in time, or this host is cut
            off from the job's store (the heartbeat found it on the far side of a partition).
    """
    recovery = _Recovery.current
    if recovery is None or not is_initialized():
        raise RuntimeError("recover() needs a world formed for in-process recovery. HINT: launch with "
                           "hvdrun --min-np/--max-np --recovery in-process.")
    watch = get_world().runtime.peer_watch if get_world().runtime is not None else None
    failure = watch.failure if watch is not None else None
    if failure is not None and failure.cut_off:
        raise RankFailedError(f"elastic: this host is cut off from the job's store, so it cannot re-form "
                              f"the world with the others; it stops. ({failure.message})")
    _drop_world()
    world = recovery.build(recovery.quorum.reform(failure.ranks if failure is not None else ()))
    if watch is not None:
        watch.forget_record()  # recovered: hvdrun's partition watch must not stop this host
    recovered()  # ends with its own status, but hard: the broken group may hang at exit
    return world


def first_survivor() -> bool:
    """After :func:`recover`: whether this rank is the lowest-ranked one of the members that
    were in the world before it (the rank that reports the re-form; rank 0 may have just
    joined). ``False`` without in-process recovery."""
    if not in_process_recovery():
        return False
    return _Recovery.current.quorum.first_survivor()  # type: ignore[union-attr]


def finish_job() -> None:
    """With in-process recovery: the training function returned, so a restarted worker still
    waiting to join ends quietly (status 0) instead of waiting. A no-op otherwise."""
    if in_process_recovery():
        _Recovery.current.quorum.finish()  # type: ignore[union-attr]


def reform_due() -> bool:
    """At a step boundary (``State.commit``): whether every member leaves the world now to admit
    a waiting worker (always ``False`` without in-process recovery). See
    :meth:`~hvd_trainer.comm.world.quorum.Quorum.reform_due`."""
    if not in_process_recovery():
        return False
    return _Recovery.current.quorum.reform_due()  # type: ignore[union-attr]


_BROKEN_GROUPS: list[Any] = []
"""Process groups of worlds that in-process recovery dropped, kept alive to the process's end."""


def _drop_world() -> None:
    """Release the current world and destroy its process group without any collective (its
    peers may be dead); errors of the broken group are ignored.

    The dropped groups stay referenced (:data:`_BROKEN_GROUPS`): a gloo group's destructor waits
    for its work in flight, and a collective with a peer on the far side of a cut link is in
    flight until the group's timeout, so destroying the last reference would hold this survivor
    that long (past hvdrun's partition watch, which then stops the host)."""
    world = get_world() if is_initialized() else None
    if world is not None:
        _BROKEN_GROUPS.extend(g for g in (world.group, world.cpu_group) if g is not None)
        if world.runtime is not None:
            _BROKEN_GROUPS.extend(world.runtime.group_handles())
    if dist.is_initialized() and dist.group.WORLD is not None:
        _BROKEN_GROUPS.append(dist.group.WORLD)
    if world is not None and world.runtime is not None:
        world.runtime.close()
    if world is not None:
        object.__setattr__(world, "group", None)
        object.__setattr__(world, "cpu_group", None)
    set_current(None)
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _wants_quorum(info: LaunchEnv, environ: Mapping[str, str] | None) -> bool:
    return recovery_env(environ).in_process and torchelastic_env(environ).under_agent \
        and info.master_addr is not None


def _make_quorum(info: LaunchEnv, timeout_seconds: float, environ: Mapping[str, str] | None) -> Quorum:
    settings = recovery_env(environ)
    store = raw_job_store(info.rank, info.size, timedelta(seconds=timeout_seconds))
    return Quorum(store, torchelastic_env(environ).run_id, slot=info.rank,
                  max_slots=max(settings.max_np, info.size), min_np=settings.min_np,
                  settle_seconds=settings.settle_seconds, timeout_seconds=timeout_seconds,
                  launched=info.size)


def shutdown() -> None:
    """Destroy the process group. Safe to call twice; ``init()`` may be called again after.

    Also registered to run at interpreter exit (as Horovod does), so scripts need not call it.
    After it, the :class:`World` and process sets a script still holds no longer reference any
    process group: a gloo group that outlives ``destroy_process_group`` is destroyed during
    interpreter finalisation instead, where its worker threads sometimes abort the process
    ("terminate called without an active exception", exit status 134) after a successful run.
    """
    world = get_world() if is_initialized() else None
    if world is not None and world.runtime is not None:
        if world.size > 1 and world.runtime.store is not None:
            # peers still waiting can name us, unless we completed the collective they wait in
            mark_exited(world.runtime.store, world.rank, last_done=world.runtime.last_done())
        world.runtime.close()  # releases every process set's groups
    if world is not None:
        # World is frozen for users; releasing its group handles is the one mutation.
        object.__setattr__(world, "group", None)
        object.__setattr__(world, "cpu_group", None)
    set_current(None)
    if dist.is_initialized():
        dist.destroy_process_group()


def _shutdown_and_collect() -> None:
    """:func:`shutdown`, then a full garbage collection, at interpreter exit: process groups
    kept alive only by reference cycles go now, not during finalisation. (Not on every
    ``shutdown()``: a full collection of a heap holding torch and Lightning takes ~0.5 s, and
    a job may cycle init/shutdown hundreds of times.)"""
    shutdown()
    gc.collect()


def _mark_current_exited() -> None:
    """Publish that this rank has exited, for the current world (a hard exit skips shutdown)."""
    world = get_world() if is_initialized() else None
    if world is not None and world.size > 1 and world.runtime is not None \
            and world.runtime.store is not None:
        mark_exited(world.runtime.store, world.rank)


@functools.cache
def _shutdown_at_exit() -> None:
    """Register :func:`_shutdown_and_collect` to run at interpreter exit, and
    :func:`_mark_current_exited` before a hard exit, once per process (registering per
    ``init`` would keep every world's store, and its sockets, alive)."""
    atexit.register(_shutdown_and_collect)
    flush_before_hard_exit(_mark_current_exited)


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

"""Process sets: collectives over a subset of ranks (Horovod's ``ProcessSet``).

A :class:`ProcessSet` wraps ``torch.distributed.new_group(ranks)``. Like ``new_group``, its
constructor is itself collective: **every rank of the job must create the same process sets in
the same order**, including ranks that are not members. This is enforced: the constructor
compares the requested ranks across the whole job first and raises
:class:`~hvd_trainer.comm.base.errors.CollectiveMismatchError` (listing each rank's request) instead of
letting ``new_group`` hang or pair up the wrong groups.

Every collective takes ``process_set=``; ``None`` (or :data:`global_process_set`) means the whole
job. ``root_rank`` arguments are always *global* ranks (as in Horovod and ``torch.distributed``).

Horovod's registration flow works too: a ``ProcessSet(ranks)`` built *before* ``init()`` is only a
description until ``hvd.init(process_sets=[...])`` or :func:`add_process_set` creates its group;
sets can be removed again with :func:`remove_process_set`. All three are collective over the whole
job (every rank calls them identically and in the same order), as in Horovod.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hvd_trainer.comm.base.config import CommConfig
from hvd_trainer.comm.base.errors import CommValueError
from hvd_trainer.comm.ops.checks import Coordinator, Signature
from hvd_trainer.comm.world.world import World, get_world, is_initialized

__all__ = ["ProcessSet", "resolve_set", "global_process_set", "by_name_group", "await_connected"]


class ProcessSet:
    """A set of global ranks that collectives can run on.

    Example:
        >>> evens = hvd.ProcessSet(range(0, hvd.size(), 2))   # on every rank, same order
        >>> if evens.included():
        ...     hvd.allreduce(t, process_set=evens)

    A set holds what its collectives need (this process's global rank, the member ranks, the
    coordinator of their cross-rank checks, the device and the process groups), not the
    :class:`World` it was created in.

    Args:
        ranks: global ranks (any order, no duplicates); sorted internally.
        world: the world to create the set in (default: the initialised one). Before
            ``init()`` (and without ``world``) the set is only recorded;
            ``init(process_sets=[...])`` or :func:`add_process_set` creates it later, on every
            rank.

    Attributes:
        ranks: the members' global ranks, sorted.
        set_id: Horovod's id (see :attr:`process_set_id`).
        global_rank: this process's global rank (``None`` while the set is only recorded).
        device: the device of this rank's world (``None`` while the set is only recorded).
        coordinator: cross-rank checks, sequence numbers and the join board of the set
            (``None`` while the set is only recorded).

    Raises:
        CommValueError: empty, duplicate or out-of-range ranks.
        CollectiveMismatchError: ranks created different sets at this point.
    """

    ranks: list[int]
    set_id: int | None
    global_rank: int | None
    device: torch.device | None
    coordinator: Coordinator | None

    def __init__(self, ranks: Sequence[int] | range, *, world: World | None = None) -> None:
        if world is None and not is_initialized():
            self.set_id, self.global_rank, self.device, self.coordinator = None, None, None, None
            self.ranks = list(_validate(ranks, None))  # a list, as Horovod's (== [0, 1] holds)
            return
        w = get_world() if world is None else world
        self._create(w, _validate(ranks, w.size))

    def _create(self, w: World, members: tuple[int, ...]) -> None:
        runtime = _runtime(w)
        # Agree first: new_group must be called with the same ranks, in the same order, on all.
        coord = runtime.global_set.coordinator
        coord.settle(coord.begin(
            Signature("new_process_set", f"process_set#{runtime.next_set_id}", (("ranks", members),)),
            0,
        ))
        group = dist.new_group(list(members))
        cpu_group = group if w.backend == "gloo" else dist.new_group(list(members), backend="gloo")
        side = by_name_group(list(members), runtime.store, runtime.config)
        if w.rank in members:
            await_connected(side if side is not None else cpu_group)
        self._setup(w, members, group, cpu_group, runtime.allocate_set_id(), side_group=side)
        runtime.sets[self.set_id] = self

    @classmethod
    def _for_world(cls, world: World, set_id: int, side_group: dist.ProcessGroup | None = None) -> ProcessSet:
        obj = cls.__new__(cls)
        obj._setup(world, tuple(range(world.size)), world.group, world.cpu_group, set_id,
                   side_group=side_group)
        return obj

    def _setup(self, world: World, members: tuple[int, ...], group, cpu_group, set_id: int, *,
               side_group: dist.ProcessGroup | None = None) -> None:
        self.global_rank = world.rank
        self.device = world.device
        self.ranks = list(members)  # a list, as Horovod's (== [0, 1] holds)
        self.set_id = set_id
        self._group = group
        self._cpu_group = cpu_group
        self.side_group = side_group
        """A gloo group of the same members for collectives matched by name (created with the
        set, collectively; ``None`` when matching by name is off or the set has one member)."""
        self.name_matcher: Any = None
        """The set's :class:`~hvd_trainer.comm.ops.by_name.NameMatcher` once one is needed."""
        self._runtime = world.runtime
        self.coordinator = _coordinator(world.runtime, world.rank, members, f"hvd/ps{set_id}")

    @property
    def process_set_id(self) -> int | None:
        """Horovod's id: 0 for the whole job, then 1, 2, ... in creation order; ``None`` while
        the set is not created yet or after :func:`remove_process_set`."""
        return self.set_id

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self.ranks)

    def included(self) -> bool:
        """Whether this process is a member.

        Raises:
            NotInitializedError: a set recorded before ``init()``, asked before ``init()``.
        """
        rank = self.global_rank if self.global_rank is not None else get_world().rank
        return rank in self.ranks

    def rank(self) -> int:
        """This process's index within the set.

        Raises:
            CommValueError: this process is not a member.
        """
        self.require_member("rank()")
        return self.ranks.index(self.global_rank)

    @property
    def removed(self) -> bool:
        """Whether the set was created and then removed (:func:`remove_process_set`)."""
        return self.set_id is None and self.global_rank is not None

    def side_set(self) -> ProcessSet:
        """The same members on :attr:`side_group`, with their own sequence numbers and checks:
        where the collectives matched by name run, off the set's ordered stream.

        Raises:
            CommValueError: the set has no side group.
        """
        if self.side_group is None:
            raise CommValueError(f"{self!r} has no group for collectives matched by name.")
        side = ProcessSet.__new__(ProcessSet)
        side.global_rank, side.device, side.set_id = self.global_rank, self.device, self.set_id
        side.ranks = list(self.ranks)
        side._group = side._cpu_group = self.side_group
        side.side_group, side.name_matcher, side._runtime = None, None, self._runtime
        side.coordinator = _coordinator(self._runtime, self.global_rank, self.ranks,
                                        f"hvd/ps{self.set_id}/by_name")
        return side

    def group_handles(self) -> list[dist.ProcessGroup]:
        """The process groups this set holds (its own, its CPU group, its side group)."""
        return [g for g in (self._group, self._cpu_group, self.side_group) if g is not None]

    def release_groups(self) -> None:
        """Stop matching by name and drop this set's process-group handles (called by
        ``shutdown``; the set is unusable afterwards, as after Horovod's shutdown)."""
        matcher = getattr(self, "name_matcher", None)
        if matcher is not None:
            matcher.close()
            self.name_matcher = None
        self._group = None
        self._cpu_group = None
        self.side_group = None
        self._ended = True

    def group_for(self, tensor: torch.Tensor) -> dist.ProcessGroup | None:
        """The process group that carries ``tensor`` (CPU tensors use the gloo group).

        Raises:
            CommValueError: the set's world has ended (``None`` would mean torch's default
                group, i.e. another world's ranks).
        """
        if getattr(self, "_ended", False):
            self._raise_ended("a collective")
        return self._cpu_group if tensor.device.type == "cpu" else self._group

    def _raise_ended(self, what: str) -> None:
        raise CommValueError(
            f"{what} got {self!r}, whose world has ended: hvd.shutdown() ran, or in-process recovery "
            "re-formed the world after a lost worker (its ranks renumbered, its size may differ), so "
            "the set's group is gone. HINT: with in-process recovery create process sets inside the "
            "function that @elastic.run wraps (every rank, same order, for the world hvd.size() "
            "gives), or launch with --recovery restart."
        )

    @property
    def cpu_group(self) -> dist.ProcessGroup | None:
        return self._cpu_group

    def require_member(self, what: str) -> None:
        """Raise :class:`CommValueError` unless this set is usable (created, not removed, its
        world not ended) and this rank is a member."""
        if getattr(self, "_ended", False):
            self._raise_ended(what)
        if self.set_id is None:
            raise CommValueError(
                f"{what} got {self!r}, which {'was removed' if self.removed else 'is not created yet'}. "
                "HINT: pass it to hvd.init(process_sets=[...]) or hvd.add_process_set(...) first, "
                "on every rank."
            )
        if not self.included():
            raise CommValueError(
                f"{what} ran on rank {self.global_rank}, which is not in process set {list(self.ranks)}. "
                "HINT: guard the call with `if process_set.included():`."
            )

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.set_id}, ranks={list(self.ranks)})"


class _GlobalProcessSet(ProcessSet):
    """:data:`global_process_set`: the whole job, whatever world is initialised right now."""

    process_set_id = 0  # type: ignore[assignment]  # known before init(), as in Horovod

    def __init__(self) -> None:  # no state: everything is read from the initialised world
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(get_world().runtime.global_set, name)

    def __repr__(self) -> str:
        if not is_initialized():
            return "ProcessSet(process_set_id=0, ranks=<all ranks, after init()>)"
        return f"ProcessSet(process_set_id=0, ranks={list(self.ranks)})"


global_process_set: ProcessSet = _GlobalProcessSet()
"""The whole job (Horovod's ``hvd.global_process_set``); the same as ``process_set=None``."""


def _coordinator(runtime: Any, rank: int, members: Sequence[int], prefix: str) -> Coordinator:
    """The cross-rank checks of a set of ``members`` keyed under ``prefix`` in the runtime's store
    (no checks for a hand-made world without a runtime)."""
    return Coordinator(
        store=runtime.store if runtime else None,
        prefix=prefix,
        rank=rank,
        ranks=members,
        config=runtime.config if runtime else CommConfig(check_signatures=False),
        timeline=runtime.timeline if runtime else None,
        peer_watch=getattr(runtime, "peer_watch", None),
    )


def await_connected(last_created: dist.ProcessGroup | None) -> None:
    """Return once every member of ``last_created`` (a gloo group, the last of the groups this
    rank just created collectively) has finished creating it, and so every group before it.

    Creating a gloo group is not a synchronization point: the rank that opens a connection
    returns as soon as it has sent its handshake, while its peer has yet to read it. Without
    this barrier a rank that destroys its groups at once (``shutdown()`` right after
    ``init()``, or exiting) can make a peer's creation fail with "Connection closed by peer".
    The barrier on the last group ends only after every member has returned from every
    creation before it. A collective over ``last_created`` (every member calls it).
    """
    if last_created is None or last_created == dist.GroupMember.NON_GROUP_MEMBER:
        return
    if dist.get_world_size(last_created) > 1:
        dist.barrier(group=last_created)


def by_name_group(members: list[int], store: Any, config: CommConfig) -> dist.ProcessGroup | None:
    """The side group of a new set of ``members`` (collective: every rank of the job calls it
    for every set, in the same order, as ``new_group``); ``None`` for one member, no store, or
    ``config.match_async_names`` off. Non-members get torch's non-member placeholder."""
    if len(members) < 2 or store is None or not config.match_async_names:
        return None
    return dist.new_group(members, backend="gloo")


def _validate(ranks: Sequence[int] | range, size: int | None) -> tuple[int, ...]:
    if isinstance(ranks, str | bytes) or not hasattr(ranks, "__iter__"):
        raise CommValueError(
            f"ProcessSet(ranks={ranks!r}) needs a sequence of global ranks, got {type(ranks).__name__}. "
            "HINT: ProcessSet([0, 2]). MPI communicators are not supported."
        )
    members = []
    for r in ranks:
        try:
            members.append(operator.index(r) if not isinstance(r, bool) else None)
        except TypeError:
            members.append(None)
    if None in members:
        raise CommValueError(f"ProcessSet(ranks={list(ranks)!r}) has non-integer ranks.")
    if not members:
        raise CommValueError("ProcessSet(ranks=[]) is empty. HINT: pass at least one rank.")
    if len(set(members)) != len(members):
        raise CommValueError(f"ProcessSet(ranks={members}) lists a rank twice.")
    bad = [r for r in members if r < 0 or (size is not None and r >= size)]
    if bad:
        raise CommValueError(
            f"ProcessSet(ranks={members}) has ranks {bad} outside a world of size {size}."
            if size is not None else f"ProcessSet(ranks={members}) has negative ranks {bad}."
        )
    return tuple(sorted(members))


def _runtime(world: World) -> Any:
    """``world.runtime`` (a :class:`~hvd_trainer.comm.runtime.CommRuntime`).

    Raises:
        CommValueError: a hand-made ``World`` without one.
    """
    if world.runtime is None:
        raise CommValueError(
            "this World has no comm runtime. HINT: obtain the world from hvd_trainer.init()."
        )
    return world.runtime


def resolve_set(process_set: ProcessSet | None, world: World | None, what: str) -> ProcessSet:
    """The process set a collective runs on: ``process_set``, else the world's global set.

    Raises:
        CommValueError: this rank is not a member of ``process_set``.
    """
    if process_set is None or isinstance(process_set, _GlobalProcessSet):
        w = get_world() if world is None else world
        if w.runtime is None:
            return ProcessSet._for_world(w, 0)
        return w.runtime.global_set
    process_set.require_member(what)
    return process_set

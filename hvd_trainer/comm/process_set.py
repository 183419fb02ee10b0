"""Process sets: collectives over a subset of ranks (Horovod's ``ProcessSet``).

A :class:`ProcessSet` wraps ``torch.distributed.new_group(ranks)``. Like ``new_group``, its
constructor is itself collective: **every rank of the job must create the same process sets in
the same order**, including ranks that are not members. This is enforced: the constructor
compares the requested ranks across the whole job first and raises
:class:`~hvd_trainer.comm.errors.CollectiveMismatchError` (listing each rank's request) instead of
letting ``new_group`` hang or pair up the wrong groups.

Every collective takes ``process_set=``; ``None`` means the whole job. ``root_rank`` arguments
are always *global* ranks (as in Horovod and ``torch.distributed``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hvd_trainer.comm.checks import Coordinator, Signature
from hvd_trainer.comm.errors import CommValueError
from hvd_trainer.comm.world import World, get_world

if TYPE_CHECKING:
    from hvd_trainer.comm.runtime import CommRuntime

__all__ = ["ProcessSet", "resolve_set"]


class ProcessSet:
    """A set of global ranks that collectives can run on.

    Example:
        >>> evens = hvd.ProcessSet(range(0, hvd.size(), 2))   # on every rank, same order
        >>> if evens.included():
        ...     hvd.allreduce(t, process_set=evens)

    Args:
        ranks: global ranks (any order, no duplicates); sorted internally.
        world: the world (default: the initialised one).

    Raises:
        CommValueError: empty, duplicate or out-of-range ranks.
        CollectiveMismatchError: ranks created different sets at this point.
    """

    def __init__(self, ranks: Sequence[int] | range, *, world: World | None = None) -> None:
        w = get_world() if world is None else world
        members = _validate(ranks, w.size)
        runtime = _runtime(w)
        # Agree first: new_group must be called with the same ranks, in the same order, on all.
        coord = runtime.global_set.coordinator
        coord.settle(coord.begin(
            Signature("new_process_set", f"process_set#{runtime.next_set_id}", (("ranks", members),)),
            0,
        ))
        group = dist.new_group(list(members))
        cpu_group = group if w.backend == "gloo" else dist.new_group(list(members), backend="gloo")
        self._setup(w, members, group, cpu_group, runtime.allocate_set_id())

    @classmethod
    def _for_world(cls, world: World, set_id: int) -> ProcessSet:
        obj = cls.__new__(cls)
        obj._setup(world, tuple(range(world.size)), world.group, world.cpu_group, set_id)
        return obj

    def _setup(self, world: World, members: tuple[int, ...], group, cpu_group, set_id: int) -> None:
        self.world = world
        self.ranks = members
        self.set_id = set_id
        self._group = group
        self._cpu_group = cpu_group
        runtime = world.runtime
        self.coordinator = Coordinator(
            store=runtime.store if runtime else None,
            prefix=f"hvd/ps{set_id}",
            rank=world.rank,
            ranks=members,
            config=runtime.config if runtime else _default_config(),
            timeline=runtime.timeline if runtime else None,
        )

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self.ranks)

    def included(self) -> bool:
        """Whether this process is a member."""
        return self.world.rank in self.ranks

    def rank(self) -> int:
        """This process's index within the set.

        Raises:
            CommValueError: this process is not a member.
        """
        self.require_member("rank()")
        return self.ranks.index(self.world.rank)

    def group_for(self, tensor: torch.Tensor) -> dist.ProcessGroup | None:
        """The process group that carries ``tensor`` (CPU tensors use the gloo group)."""
        return self._cpu_group if tensor.device.type == "cpu" else self._group

    @property
    def cpu_group(self) -> dist.ProcessGroup | None:
        return self._cpu_group

    def require_member(self, what: str) -> None:
        if not self.included():
            raise CommValueError(
                f"{what} ran on rank {self.world.rank}, which is not in process set {list(self.ranks)}. "
                "HINT: guard the call with `if process_set.included():`."
            )

    def __repr__(self) -> str:
        return f"ProcessSet(ranks={list(self.ranks)})"


def _validate(ranks: Sequence[int] | range, size: int) -> tuple[int, ...]:
    members = [int(r) for r in ranks]
    if not members:
        raise CommValueError("ProcessSet(ranks=[]) is empty. HINT: pass at least one rank.")
    if len(set(members)) != len(members):
        raise CommValueError(f"ProcessSet(ranks={members}) lists a rank twice.")
    bad = [r for r in members if not 0 <= r < size]
    if bad:
        raise CommValueError(
            f"ProcessSet(ranks={members}) has ranks {bad} outside a world of size {size}."
        )
    return tuple(sorted(members))


def _runtime(world: World) -> CommRuntime:
    if world.runtime is None:
        raise CommValueError(
            "this World has no comm runtime. HINT: obtain the world from hvd_trainer.init()."
        )
    return world.runtime


def _default_config():
    from hvd_trainer.comm.config import CommConfig

    return CommConfig(check_signatures=False)


def resolve_set(process_set: ProcessSet | None, world: World | None, what: str) -> ProcessSet:
    """The process set a collective runs on: ``process_set``, else the world's global set.

    Raises:
        CommValueError: this rank is not a member of ``process_set``.
    """
    if process_set is None:
        w = get_world() if world is None else world
        if w.runtime is None:
            return ProcessSet._for_world(w, 0)
        return w.runtime.global_set
    process_set.require_member(what)
    return process_set

"""Horovod's process-set registry: ``init(process_sets=[...])``, :func:`add_process_set` and
:func:`remove_process_set`.

Each call is collective over the *whole job*: every rank makes the same calls with the same
ranks in the same order (Horovod's rule for dynamic process sets). The ranks are compared across
the job first, so a rank that asks for something else gets
:class:`~hvd_trainer.comm.base.errors.CollectiveMismatchError` instead of a hang.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch.distributed as dist

from hvd_trainer.comm.base.errors import CommTypeError, CommValueError
from hvd_trainer.comm.ops.checks import Signature
from hvd_trainer.comm.ops.process_set import ProcessSet, _GlobalProcessSet, _validate
from hvd_trainer.comm.world.world import World, get_world

__all__ = ["add_process_set", "remove_process_set", "register_process_sets", "process_set_ranks",
           "HorovodBasics"]


def _agree(world: World, kind: str, ranks: tuple[int, ...]) -> None:
    """Check that every rank of the job makes this same registry call now."""
    runtime = world.runtime
    if runtime is None:
        raise CommValueError("this World has no comm runtime. HINT: use the world from hvd_trainer.init().")
    coord = runtime.global_set.coordinator
    coord.settle(coord.begin(Signature(kind, None, (("ranks", ranks),)), 0))


def _duplicate_of(world: World, ranks: tuple[int, ...]) -> ProcessSet | None:
    for pset in list(world.runtime.sets.values()):
        if tuple(pset.ranks) == tuple(ranks) and pset.set_id is not None:
            return pset
    return None


def add_process_set(
    process_set: ProcessSet | Sequence[int] | range, *, world: World | None = None
) -> ProcessSet:
    """Create a process set on every rank and return it (Horovod's ``hvd.add_process_set``).

    Collective over the whole job: call it on every rank, identically, in the same order.

    Args:
        process_set: a list of global ranks, or a :class:`ProcessSet` recorded before
            ``init()``. A set that already works (built after ``init()``) is returned as is.

    Returns:
        The created :class:`ProcessSet`, usable as ``process_set=`` on every collective.

    Raises:
        CommValueError: empty, duplicate, negative or out-of-range ranks; a live set (including
            the whole job, id 0) already has exactly these ranks (Horovod forbids duplicates).
        CollectiveMismatchError: the ranks asked for different sets.
        NotInitializedError: before ``init()``.
    """
    w = get_world() if world is None else world
    if isinstance(process_set, _GlobalProcessSet):
        raise CommValueError("add_process_set(global_process_set): the whole job is always registered "
                             "(id 0). HINT: use hvd.global_process_set directly.")
    if isinstance(process_set, ProcessSet):
        if process_set.set_id is not None:
            return process_set
        if process_set.removed:
            raise CommValueError(f"add_process_set({process_set!r}): this set was removed. "
                                 "HINT: build a new one with hvd.add_process_set(ranks).")
        target, ranks = process_set, tuple(process_set.ranks)
    else:
        target, ranks = None, _validate(process_set, None)
    ranks = _validate(ranks, w.size)
    _agree(w, "add_process_set", ranks)
    existing = _duplicate_of(w, ranks)
    if existing is not None:
        raise CommValueError(
            f"add_process_set(ranks={list(ranks)}): {existing!r} already has these ranks. "
            "HINT: reuse that set, or remove_process_set() it first."
        )
    if target is None:
        target = ProcessSet.__new__(ProcessSet)
    target._create(w, ranks)
    return target


def remove_process_set(process_set: ProcessSet, *, world: World | None = None) -> bool:
    """Remove a set created by :func:`add_process_set`, ``init(process_sets=)`` or
    ``ProcessSet(ranks)`` (Horovod's ``hvd.remove_process_set``).

    Collective over the whole job, like :func:`add_process_set`. Operations still running on
    the set are waited for; afterwards ``process_set_id`` is ``None`` and collectives on the
    set raise :class:`CommValueError`. The torch process group is destroyed on its members.

    Returns:
        ``True`` when the set was removed; ``False`` when it was never created or was already
        removed (as in Horovod).

    Raises:
        CommValueError: ``process_set`` is the whole job (Horovod returns ``False`` there;
            removing it is always a bug, so hvd_trainer says so).
        CommTypeError: not a :class:`ProcessSet`.
        CollectiveMismatchError: the ranks removed different sets.
    """
    if not isinstance(process_set, ProcessSet):
        raise CommTypeError(f"remove_process_set expects a ProcessSet, got {type(process_set).__name__}.")
    w = get_world() if world is None else world
    if isinstance(process_set, _GlobalProcessSet) or process_set.set_id == 0:
        raise CommValueError(
            "remove_process_set(global_process_set): the whole job cannot be removed. "
            "HINT: remove only sets you added; call hvd.shutdown() to end the job."
        )
    # Created in this world (not in one that was shut down since) and not removed yet.
    live = w.runtime.sets if w.runtime is not None else {}
    removable = process_set.set_id is not None and live.get(process_set.set_id) is process_set
    _agree(w, "remove_process_set", process_set.ranks if removable else ())
    if not removable:
        return False
    coord = process_set.coordinator
    for pending in sorted(coord.outstanding.values(), key=lambda o: o.seq):
        coord.wait(pending)
    w.runtime.sets.pop(process_set.set_id, None)
    if process_set.name_matcher is not None:  # its collectives that never matched fail now
        process_set.name_matcher.close()
        process_set.name_matcher = None
    if process_set.included():
        groups = {id(g): g for g in (process_set._group, process_set._cpu_group, process_set.side_group)
                  if g is not None}
        for group in groups.values():
            dist.destroy_process_group(group)
    process_set.set_id = None
    process_set._group = process_set._cpu_group = process_set.side_group = None
    return True


def process_set_ranks(*, world: World | None = None) -> dict[int, list[int]]:
    """Every live process set of ``world`` (default: the current one), by id: its global ranks
    in order (id 0, the whole job, included).

    Raises:
        NotInitializedError: no world.
    """
    w = get_world() if world is None else world
    live = w.runtime.sets if w.runtime is not None else {0: ProcessSet._for_world(w, 0)}
    return {set_id: list(pset.ranks) for set_id, pset in sorted(live.items())}


class HorovodBasics:
    """What Horovod code reaches as ``mpi_ops._basics`` (``horovod.common.basics.HorovodBasics``)
    beyond the module-level functions: its process-set query, which Horovod's own process-set
    tests use."""

    @staticmethod
    def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
        """:func:`process_set_ranks` of the current world."""
        return process_set_ranks()


def register_process_sets(
    process_sets: Iterable[ProcessSet] | str | None, *, world: World | None = None
) -> list[ProcessSet]:
    """Create the sets passed to ``init(process_sets=...)``, in order, on every rank.

    Args:
        process_sets: ``None``, ``"dynamic"`` (nothing to create: sets can always be added
            later), or a list of :class:`ProcessSet` recorded before ``init()``.

    Returns:
        The created sets, in the given order.

    Raises:
        CommValueError: an entry duplicates another entry or the whole job (Horovod's
            "duplicate process set" error), or a string other than ``"dynamic"``.
        CommTypeError: an entry is not a :class:`ProcessSet`.
    """
    if process_sets is None:
        return []
    if isinstance(process_sets, str):
        if process_sets.lower() == "dynamic":
            return []
        raise CommValueError(f"init(process_sets={process_sets!r}): expected a list of ProcessSet or "
                             "'dynamic'.")
    process_sets = list(process_sets)
    for i, pset in enumerate(process_sets):
        if not isinstance(pset, ProcessSet):
            raise CommTypeError(
                f"init(process_sets=...) entry {i} is a {type(pset).__name__}, not a ProcessSet. "
                "HINT: process_sets=[hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 3])]."
            )
    _check_no_duplicates(process_sets, get_world() if world is None else world)
    return [add_process_set(pset, world=world) for pset in process_sets]


def _check_no_duplicates(process_sets: list[ProcessSet], world: World) -> None:
    """Refuse the whole list before creating any set (so no set id is used up): an entry with
    the same ranks as an earlier entry, as the whole job, or as a set already created."""
    seen = {tuple(range(world.size)): "the whole job (process set 0)"}
    live = world.runtime.sets if world.runtime is not None else {}
    for pset in list(live.values()):
        if pset.set_id is not None:
            seen.setdefault(tuple(pset.ranks), f"process set {pset.set_id}")
    for i, pset in enumerate(process_sets):
        ranks = tuple(sorted(pset.ranks))
        if pset.set_id is not None and live.get(pset.set_id) is pset:
            continue  # created already: add_process_set hands it back
        if ranks in seen:
            raise CommValueError(
                f"init(process_sets=...) entry {i} (ranks {list(ranks)}) duplicates {seen[ranks]}; "
                "nothing was created. HINT: list each set of ranks once."
            )
        seen[ranks] = f"entry {i}"



"""The comm layer's per-world runtime state: config, store, timeline and the process sets.

Created by :func:`hvd_trainer.comm.session.init` and reachable only through ``World.runtime``
(no module globals). It sits above :mod:`~hvd_trainer.comm.ops.process_set`: a process set reads
the runtime's config, store and timeline through ``World.runtime`` and never imports this module.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch.distributed as dist

from hvd_trainer.comm.base.config import CommConfig
from hvd_trainer.comm.base.store import default_store
from hvd_trainer.comm.ops.process_set import ProcessSet, await_connected, by_name_group
from hvd_trainer.comm.ops.timeline import Timeline, rank_path
from hvd_trainer.comm.world.heartbeat import PeerWatch
from hvd_trainer.comm.world.liveness import publish
from hvd_trainer.comm.world.membership import check_membership
from hvd_trainer.comm.world.world import World

__all__ = ["CommRuntime"]

_LOCAL_SIZE_KEY = "hvd/local_size/{rank}"


_runtimes_created = 0
"""How many runtimes (``init`` calls that built a world) this process has made."""


def _runtime_store(namespace: str | None = None) -> tuple[Any, str]:
    """The default group's store under a prefix unique to this runtime (``None`` before init),
    and the prefix. ``namespace``: a prefix every rank of the world agrees on (in-process
    recovery: the membership's number, since a joiner has built fewer runtimes than survivors).

    Every rank builds the same number of runtimes (one per ``init`` after a ``shutdown`` or a
    destroyed process group), so the prefixes agree. Keys a previous world left behind (join
    rounds, signature entries, liveness marks) in a store that outlives it - torchrun's agent
    store, or a group the user created again on the same ``MASTER_PORT`` - are never read.
    """
    global _runtimes_created
    store = default_store()
    if store is None:
        return None, ""
    _runtimes_created += 1
    prefix = f"hvd_rt/{_runtimes_created}" if namespace is None else f"hvd_rt/{namespace}"
    return dist.PrefixStore(prefix, store), prefix


class CommRuntime:
    """Mutable state shared by every collective of one world."""

    def __init__(self, config: CommConfig, rank: int, namespace: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.store: Any
        self.store, self.namespace = _runtime_store(namespace)
        path = config.timeline_path
        self.timeline = Timeline(rank_path(path, rank), rank=rank) if path else None
        self._next_set_id = 1
        self.global_set: ProcessSet  # set by attach()
        # Live process sets by id (weak: a set nobody holds may be collected).
        self.sets: weakref.WeakValueDictionary[int, ProcessSet] = weakref.WeakValueDictionary()
        self._homogeneous: bool | None = None
        self._size = 1
        self.peer_watch: PeerWatch | None = None
        """The heartbeat of a job on several hosts (``None`` on one host or when disabled)."""

    def attach(self, world: World, store_endpoint: tuple[str | None, int | None] = (None, None)) -> None:
        """Check that every rank holds the job's secret (:mod:`~hvd_trainer.comm.world.membership`),
        create ``world``'s global process set (id 0) and publish this rank in the store
        (its ``local_size`` for :meth:`homogeneous`, its host and pid for liveness); on several
        hosts, start the heartbeat on the store at ``store_endpoint`` (``MASTER_ADDR``, ``MASTER_PORT``)."""
        self._size = world.size
        if self.store is not None and world.size > 1:
            # before anything is exchanged: a stranger in the rendezvous stops the job here
            check_membership(self.store, world.rank, world.size, self.namespace)
        self.peer_watch = self._start_watch(world, store_endpoint)
        side = by_name_group(list(range(world.size)), self.store, self.config)
        if world.size > 1:  # init() returns on no rank before every rank has connected every group
            await_connected(side if side is not None else world.cpu_group)
        self.global_set = ProcessSet._for_world(world, 0, side_group=side)
        self.sets[0] = self.global_set
        if self.store is not None and world.size > 1:
            self.store.set(_LOCAL_SIZE_KEY.format(rank=world.rank), str(world.local_size))
            publish(self.store, world.rank)  # so a failed collective can name a dead rank

    def _start_watch(self, world: World, endpoint: tuple[str | None, int | None]) -> PeerWatch | None:
        """A started :class:`PeerWatch` when the world spans several hosts and a timeout is set."""
        host, port = endpoint
        if world.size <= world.local_size or not self.config.peer_timeout_seconds or not host or not port:
            return None
        # Unique per world: the agent's store outlives restarts and init/shutdown cycles.
        prefix = (f"hvd_hb/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{self.namespace}")
        watch = PeerWatch(store_host=host, store_port=port, key_prefix=prefix, rank=world.rank,
                          size=world.size, timeout_seconds=self.config.peer_timeout_seconds,
                          job_dir=os.environ.get("HVDRUN_JOB_DIR"))
        watch.start()
        return watch

    @property
    def next_set_id(self) -> int:
        return self._next_set_id

    def allocate_set_id(self) -> int:
        set_id = self._next_set_id
        self._next_set_id += 1
        return set_id

    def homogeneous(self) -> bool:
        """Whether every rank published the same ``local_size`` (read once, then cached)."""
        if self._homogeneous is None:
            keys = [_LOCAL_SIZE_KEY.format(rank=r) for r in range(self._size)]
            values = {bytes(self.store.get(k)) for k in keys}
            self._homogeneous = len(values) == 1
        return self._homogeneous

    def last_done(self) -> dict[str, tuple[int, str]]:
        """The last collective this rank completed on each of its process sets (and their sides
        for collectives matched by name), by the set coordinator's store prefix: ``(seq, encoded
        signature)``; recorded at shutdown (:func:`~hvd_trainer.comm.world.liveness.mark_exited`)."""
        out: dict[str, tuple[int, str]] = {}
        for pset in [*self.sets.values(), getattr(self, "global_set", None)]:
            coords = [getattr(pset, "coordinator", None)]
            matcher = getattr(pset, "name_matcher", None)
            if matcher is not None:
                coords.append(matcher.side.coordinator)
            for coord in coords:
                if coord is not None and coord.last_done is not None:
                    out[coord.prefix] = coord.last_done
        return out

    def set_timeline(self, timeline: Timeline | None) -> None:
        """Route every process set's events to ``timeline`` (``None``: record nothing)."""
        self.timeline = timeline
        for pset in list(self.sets.values()):
            pset.coordinator.timeline = timeline

    def group_handles(self) -> list[Any]:
        """Every process group the live process sets hold (their own, CPU and side groups)."""
        out: list[Any] = []
        for pset in [*self.sets.values(), getattr(self, "global_set", None)]:
            if pset is not None:
                out.extend(pset.group_handles())
        return out

    def close(self) -> None:
        """Stop the heartbeat, flush the timeline and drop every process set's group handles
        (see ``shutdown``)."""
        if self.peer_watch is not None:
            self.peer_watch.stop()
        if self.timeline is not None:
            self.timeline.close()
        for pset in [*self.sets.values(), getattr(self, "global_set", None)]:
            if pset is not None:
                pset.release_groups()

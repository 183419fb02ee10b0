"""The comm layer's per-world runtime state: config, store, timeline and the global process set.

Created by :func:`hvd_trainer.comm.world.init` and reachable only through ``World.runtime``
(no module globals).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hvd_trainer.comm.checks import default_store
from hvd_trainer.comm.config import CommConfig
from hvd_trainer.comm.timeline import Timeline

if TYPE_CHECKING:
    from hvd_trainer.comm.process_set import ProcessSet
    from hvd_trainer.comm.world import World

__all__ = ["CommRuntime"]


class CommRuntime:
    """Mutable state shared by every collective of one world."""

    def __init__(self, config: CommConfig, rank: int) -> None:
        self.config = config
        self.store: Any = default_store()
        self.timeline = Timeline(config.timeline_path) if config.timeline_path and rank == 0 else None
        self._next_set_id = 1
        self.global_set: ProcessSet  # set by attach()

    def attach(self, world: World) -> None:
        from hvd_trainer.comm.process_set import ProcessSet

        self.global_set = ProcessSet._for_world(world, 0)
        if world.size > 1 and self.store is not None:
            from hvd_trainer.comm.liveness import publish

            publish(self.store, world.rank)  # so a failed collective can name a dead rank

    @property
    def next_set_id(self) -> int:
        return self._next_set_id

    def allocate_set_id(self) -> int:
        set_id = self._next_set_id
        self._next_set_id += 1
        return set_id

    def close(self) -> None:
        if self.timeline is not None:
            self.timeline.close()

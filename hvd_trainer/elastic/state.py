"""Elastic training state: ``commit()`` a snapshot, ``restore()`` it, ``sync()`` it from rank 0.

With torchrun's elastic agent a lost worker means *all* workers are restarted as new
processes, so a commit is also written to a file by each node's local rank 0, and
:func:`hvd_trainer.elastic.run` reads the newest one back at start-up, before ``sync()`` makes
every rank equal to it.

What a commit costs: ``commit()`` returns once the state is snapshotted in memory (every
tensor copied to CPU: about the cost of a deep copy, so committing every batch as Horovod's
examples do stays cheap); the file is written atomically on a background thread
(:mod:`hvd_trainer.elastic.persist`). The file is always one complete commit: a process killed
during a write leaves the previous one, and a burst of commits writes only the newest.
Later in-place updates of the parameters never reach a commit that already returned.

Example::

    state = TorchState(model, optimizer, epoch=0, step=0, sampler=sampler)
    state.step += 1
    state.commit()          # snapshot in memory; <checkpoint_dir>/elastic_state.pt in the background
    state.restore()         # back to the last commit
    state.flush()           # wait until the file holds the last commit
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hvd_trainer.checkpoint import load_checkpoint
from hvd_trainer.comm import HostsUpdatedInterrupt, World, broadcast_object, get_world, reform_due
from hvd_trainer.elastic.persist import BackgroundWriter, snapshot_to_cpu
from hvd_trainer.elastic.rng_state import capture_rng_states, restore_rng_states

__all__ = ["State", "ObjectState", "TorchState", "STATE_FILENAME"]

STATE_FILENAME = "elastic_state.pt"

_RESERVED = frozenset({"commit", "restore", "sync", "save", "load", "flush", "register_reset_callbacks"})


def _has_state_dict(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


class State:
    """Named values to commit, restore and sync; subclasses add framework objects.

    Keyword arguments become attributes (``state.epoch``). A value with
    ``state_dict()``/``load_state_dict()`` (a sampler, a scheduler) is captured through them
    and restored in place; any other value is deep-copied and re-assigned.

    Each commit also keeps this process's random-number generator states
    (:mod:`hvd_trainer.elastic.rng_state`: torch, CUDA, numpy, Python; in memory only, never
    sent to other ranks or written to the file), and :meth:`restore` sets them back, so the
    steps a survivor of in-process recovery trains again draw the random numbers they drew the
    first time (dropout masks, augmentation). :meth:`sync` leaves every rank's generators as
    they are (each rank keeps drawing its own numbers).

    Raises:
        ValueError: a keyword shadows a method name (``commit``, ``sync``, ...).
    """

    def __init__(self, **extra: Any) -> None:
        bad = sorted(_RESERVED.intersection(extra))
        if bad:
            raise ValueError(f"State keyword(s) {bad} shadow State methods. HINT: rename them.")
        self._names = list(extra)
        self._saved: dict[str, Any] | None = None
        self._saved_rng: Any = None  # this process's generators at the last commit (or sync)
        self._commit_count = 0
        self._path: Path | None = None
        self._writer = True
        self._persist = BackgroundWriter()
        self._reset_callbacks: list[Callable[[], None]] = []
        for name, value in extra.items():
            setattr(self, name, value)

    # -- subclass hooks -------------------------------------------------------------------
    def _before_sync(self, world: World, root_rank: int) -> None:
        """Every rank, at the start of :meth:`sync` (before the root captures): collectives a
        subclass needs for the root's capture."""
    def _capture_rng(self) -> Any:
        """This process's random-number generator states (kept with a commit, never sent)."""
        return capture_rng_states()

    def _restore_rng(self, states: Any) -> None:
        restore_rng_states(states)

    def _capture(self) -> dict[str, Any]:
        out = {}
        for name in self._names:
            value = getattr(self, name)
            out[name] = snapshot_to_cpu(value.state_dict() if _has_state_dict(value) else value)
        return out

    def _apply(self, snapshot: dict[str, Any]) -> None:
        for name in self._names:
            current = getattr(self, name)
            if _has_state_dict(current):
                current.load_state_dict(copy.deepcopy(snapshot[name]))
            else:
                setattr(self, name, copy.deepcopy(snapshot[name]))

    # -- public API -----------------------------------------------------------------------
    @property
    def commit_count(self) -> int:
        """How many commits this state has (carried over restarts through the file)."""
        return self._commit_count

    def commit(self) -> None:
        """Snapshot the state in memory; when a file is attached, write it in the background.

        Returns once the snapshot is taken (later in-place changes do not reach it); the file
        follows atomically (:meth:`flush` waits for it). With in-process recovery a commit is
        also the step boundary where a restarted worker is let in: every rank raises
        ``HostsUpdatedInterrupt`` at the same commit (as Horovod's ``commit`` does when hosts
        changed), and ``elastic.run`` re-forms the world and calls the function again.

        Raises:
            PersistError: the previous background write failed.
            HostsUpdatedInterrupt: a worker waits to join (in-process recovery; after the commit).
        """
        self._saved = self._capture()
        self._saved_rng = self._capture_rng()
        self._commit_count += 1
        if self._path is not None and self._writer:
            self._persist.submit({"commit_count": self._commit_count, "state": self._saved}, self._path)
        if reform_due():
            raise HostsUpdatedInterrupt(skip_sync=False)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the attached file holds the last commit; ``False`` if ``timeout`` (s) ran out.

        Raises:
            PersistError: a background write failed.
        """
        return self._persist.flush(timeout)

    def restore(self) -> None:
        """Return to the last commit (no-op before the first commit), this process's random
        generators included."""
        if self._saved is not None:
            self._apply(self._saved)
        if self._saved_rng is not None:
            self._restore_rng(self._saved_rng)

    def sync(self, world: World | None = None, *, root_rank: int = 0) -> None:
        """Make every rank's state equal to ``root_rank``'s (broadcast over ``hvd_trainer.comm``).

        The synced state also becomes the committed snapshot, so ``restore()`` after
        ``sync()`` returns to it (with each rank's random generators as they were at the sync).

        Args:
            world: the world to sync over (default: the initialised one).
            root_rank: the rank whose state wins (0, as in Horovod; ``elastic.run`` passes the
                rank that read the newest commit).

        Raises:
            NotInitializedError: no ``world`` and :func:`hvd_trainer.init` has not run.
        """
        world = get_world() if world is None else world
        self._before_sync(world, root_rank)
        payload = (self._commit_count, self._capture()) if world.rank == root_rank else None
        self._commit_count, snapshot = broadcast_object(
            payload, root_rank=root_rank, name="elastic.State.sync", world=world
        )
        self._apply(snapshot)
        self._saved, self._saved_rng = snapshot, self._capture_rng()

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions to call after the state was reloaded from a commit at a restart."""
        self._reset_callbacks.extend(callbacks)

    # -- persistence (used by elastic.run) ------------------------------------------------
    def attach_file(self, path: str | Path | None, *, writer: bool) -> None:
        """Persist commits to ``path`` (written only where ``writer`` is true; ``None`` = off)."""
        self._path = None if path is None else Path(path)
        self._writer = writer

    def load_committed(self) -> bool:
        """Load the attached file into the state if it exists; return whether it did.

        The file is always a complete commit (see :mod:`hvd_trainer.elastic.persist`).
        """
        if self._path is None or not self._path.is_file():
            return False
        data = load_checkpoint(self._path)
        self._commit_count = int(data["commit_count"])
        self._saved = data["state"]
        self._apply(self._saved)
        return True

    def on_reset(self) -> None:
        """Run the registered reset callbacks (after a restart resumed from a commit)."""
        for callback in self._reset_callbacks:
            callback()


class ObjectState(State):
    """A :class:`State` of plain picklable values (``ObjectState(epoch=0, best=None)``)."""


class TorchState(State):
    """Elastic state of a torch ``model`` and ``optimizer`` plus any extra values.

    ``commit()`` copies ``model.state_dict()`` and ``optimizer.state_dict()`` to CPU;
    ``restore()``/``sync()`` load them back in place (parameters keep their device). With a
    ZeRO ``DistributedOptimizer`` (``zero_stage`` 1 or 2) ``commit()`` is a collective: every
    rank gathers the full optimizer state into its commit (CPU memory of an unsharded
    optimizer's state), so the shards of a lost rank survive and a re-formed world plans its
    shards again from it; ``sync()`` sends the root's last commit of it. As in
    Horovod both are optional: ``TorchState(sampler=sampler, epoch=0)`` tracks only a sampler
    and values. Further models, optimizers, schedulers and samplers may be passed by keyword;
    anything with ``state_dict()``/``load_state_dict()`` is restored in place.

    Args:
        model: a ``torch.nn.Module`` (or anything with ``state_dict``/``load_state_dict``), or ``None``.
        optimizer: a ``torch.optim.Optimizer`` or ``None``.
        **extra: further named values (epoch, step, samplers, schedulers, ...).

    Raises:
        TypeError: ``model``/``optimizer`` lacks ``state_dict()``/``load_state_dict()``.
    """

    def __init__(self, model: Any | None = None, optimizer: Any | None = None, **extra: Any) -> None:
        for name, obj in (("model", model), ("optimizer", optimizer)):
            if obj is not None and not _has_state_dict(obj):
                raise TypeError(
                    f"TorchState {name} must have state_dict()/load_state_dict(), got "
                    f"{type(obj).__name__}. HINT: pass the nn.Module / torch.optim.Optimizer."
                )
        self.model = model
        self.optimizer = optimizer
        self._sync_source: str | None = None  # ZeRO: where the sync root's optimizer state comes from
        super().__init__(**extra)

    def _sharding(self) -> Any | None:
        """The optimizer's ZeRO sharding (``DistributedOptimizer(zero_stage=1|2)``), else None."""
        return getattr(self.optimizer, "zero_sharding", None)

    def _before_sync(self, world: World, root_rank: int) -> None:
        self._sync_source = None
        if self._sharding() is None:
            return
        # the root sends its commit's full optimizer state when it has one (a survivor after a
        # re-form: its shards may be planned for a world that is gone); else the shards now
        root = world.rank == root_rank
        has_commit = self._saved is not None if root else None
        if broadcast_object(has_commit, root_rank=root_rank, name="elastic.TorchState.zero", world=world):
            source = "commit"
        else:
            self.optimizer.consolidate_state_dict(to=root_rank)
            source = "gathered"
        self._sync_source = source if root else None  # what the root's capture reads

    def _optimizer_state(self) -> dict[str, Any]:
        sharding = self._sharding()
        if sharding is None:
            return self.optimizer.state_dict()
        source, self._sync_source = self._sync_source, None
        if source == "commit":
            assert self._saved is not None
            return self._saved["__optimizer__"]
        if source is None:  # commit(): every rank keeps the full state, so a lost shard survives
            self.optimizer.consolidate_state_dict(to=None)
        return sharding.pop_state_dict()

    def _capture(self) -> dict[str, Any]:
        out = super()._capture()
        optimizer = None if self.optimizer is None else snapshot_to_cpu(self._optimizer_state())
        if self.model is not None:  # after the optimizer's: ZeRO's gather finishes its exchange
            out["__model__"] = snapshot_to_cpu(self.model.state_dict())
        if optimizer is not None:
            out["__optimizer__"] = optimizer
        return out

    def _apply(self, snapshot: dict[str, Any]) -> None:
        super()._apply(snapshot)
        if self.model is not None:
            self.model.load_state_dict(snapshot["__model__"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(snapshot["__optimizer__"]))

"""Elastic training state: ``commit()`` a snapshot, ``restore()`` it, ``sync()`` it from rank 0.

With torchrun's elastic agent a lost worker means *all* workers are restarted as new
processes, so a commit is also written to a file (atomically, by each node's local rank 0)
and :func:`hvd_trainer.elastic.run` reads it back at start-up, before ``sync()`` makes every
rank equal to the new rank 0.

Example::

    state = TorchState(model, optimizer, epoch=0, step=0, sampler=sampler)
    state.step += 1
    state.commit()          # snapshot in memory + <checkpoint_dir>/elastic_state.pt
    state.restore()         # back to the last commit
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hvd_trainer.checkpoint import atomic_save, load_checkpoint
from hvd_trainer.comm import World, broadcast_object, get_world

__all__ = ["State", "ObjectState", "TorchState", "STATE_FILENAME"]

STATE_FILENAME = "elastic_state.pt"

_RESERVED = frozenset({"commit", "restore", "sync", "save", "load", "register_reset_callbacks"})


def _to_cpu(value: Any) -> Any:
    """A deep copy with every tensor detached and moved to CPU (safe to pickle and broadcast)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return copy.deepcopy(value)


def _has_state_dict(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


class State:
    """Named values to commit, restore and sync; subclasses add framework objects.

    Keyword arguments become attributes (``state.epoch``). A value with
    ``state_dict()``/``load_state_dict()`` (a sampler, a scheduler) is captured through them
    and restored in place; any other value is deep-copied and re-assigned.

    Raises:
        ValueError: a keyword shadows a method name (``commit``, ``sync``, ...).
    """

    def __init__(self, **extra: Any) -> None:
        bad = sorted(_RESERVED.intersection(extra))
        if bad:
            raise ValueError(f"State keyword(s) {bad} shadow State methods. HINT: rename them.")
        self._names = list(extra)
        self._saved: dict[str, Any] | None = None
        self._commit_count = 0
        self._path: Path | None = None
        self._writer = True
        self._reset_callbacks: list[Callable[[], None]] = []
        for name, value in extra.items():
            setattr(self, name, value)

    # -- subclass hooks -------------------------------------------------------------------
    def _capture(self) -> dict[str, Any]:
        out = {}
        for name in self._names:
            value = getattr(self, name)
            out[name] = _to_cpu(value.state_dict()) if _has_state_dict(value) else _to_cpu(value)
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
        """Snapshot the state in memory and, when a file is attached, write it atomically."""
        self._saved = self._capture()
        self._commit_count += 1
        if self._path is not None and self._writer:
            atomic_save({"commit_count": self._commit_count, "state": self._saved}, self._path)

    def restore(self) -> None:
        """Return to the last commit (no-op before the first commit)."""
        if self._saved is not None:
            self._apply(self._saved)

    def sync(self, world: World | None = None) -> None:
        """Make every rank's state equal to rank 0's (broadcast over ``hvd_trainer.comm``).

        The synced state also becomes the committed snapshot, so ``restore()`` after
        ``sync()`` returns to it.

        Args:
            world: the world to sync over (default: the initialised one).

        Raises:
            NotInitializedError: no ``world`` and :func:`hvd_trainer.init` has not run.
        """
        world = get_world() if world is None else world
        payload = (self._commit_count, self._capture()) if world.rank == 0 else None
        self._commit_count, snapshot = broadcast_object(
            payload, root_rank=0, name="elastic.State.sync", world=world
        )
        self._apply(snapshot)
        self._saved = snapshot

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions to call after the state was reloaded from a commit at a restart."""
        self._reset_callbacks.extend(callbacks)

    # -- persistence (used by elastic.run) ------------------------------------------------
    def attach_file(self, path: str | Path | None, *, writer: bool) -> None:
        """Persist commits to ``path`` (written only where ``writer`` is true; ``None`` = off)."""
        self._path = None if path is None else Path(path)
        self._writer = writer

    def load_committed(self) -> bool:
        """Load the attached file into the state if it exists; return whether it did."""
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
    ``restore()``/``sync()`` load them back in place (parameters keep their device).

    Args:
        model: a ``torch.nn.Module`` (or anything with ``state_dict``/``load_state_dict``).
        optimizer: a ``torch.optim.Optimizer`` or ``None``.
        **extra: further named values (epoch, step, samplers, schedulers, ...).
    """

    def __init__(self, model: Any, optimizer: Any | None = None, **extra: Any) -> None:
        for name, obj in (("model", model), ("optimizer", optimizer)):
            if obj is not None and not _has_state_dict(obj):
                raise TypeError(
                    f"TorchState {name} must have state_dict()/load_state_dict(), got "
                    f"{type(obj).__name__}. HINT: pass the nn.Module / torch.optim.Optimizer."
                )
        self.model = model
        self.optimizer = optimizer
        super().__init__(**extra)

    def _capture(self) -> dict[str, Any]:
        out = super()._capture()
        out["__model__"] = _to_cpu(self.model.state_dict())
        if self.optimizer is not None:
            out["__optimizer__"] = _to_cpu(self.optimizer.state_dict())
        return out

    def _apply(self, snapshot: dict[str, Any]) -> None:
        super()._apply(snapshot)
        self.model.load_state_dict(snapshot["__model__"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(snapshot["__optimizer__"]))

"""Persist elastic commits off the training thread: snapshot now, write the file in the background.

A commit has two halves with different costs. The *snapshot* (every tensor copied to CPU)
must finish before ``commit()`` returns, so that later in-place updates of the parameters
cannot leak into it; it costs about what an in-memory deep copy costs. The *write* (pickle,
write, ``fsync``, rename) costs several times more and only matters after a restart, so
:class:`BackgroundWriter` does it on a worker thread while training goes on.

Guarantees:

* The file on disk is always one complete commit: each write goes through
  :func:`hvd_trainer.checkpoint.atomic_save` (temp file + ``fsync`` + ``os.replace``), so a
  process killed (even by ``SIGKILL``) during a write leaves the previous complete file.
* Newest wins: while a write runs, further commits replace the one waiting; the waiting one is
  written next. So a burst of commits costs one write at a time and the file catches up to the
  newest commit as soon as the disk allows.
* A normal interpreter exit waits for the pending write (the thread is not a daemon);
  :meth:`BackgroundWriter.flush` waits explicitly and re-raises a failed write.

Example::

    writer = BackgroundWriter()
    writer.submit({"step": 3, "model": snapshot_to_cpu(model.state_dict())}, "ckpt/elastic.pt")
    writer.flush()    # the file now holds step 3 (or raises the write's error)
"""

from __future__ import annotations

import copy
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from hvd_trainer.checkpoint import atomic_save

__all__ = ["BackgroundWriter", "PersistError", "snapshot_to_cpu"]


class PersistError(RuntimeError):
    """A background write of an elastic commit failed (raised at the next submit or flush)."""


def snapshot_to_cpu(value: Any) -> Any:
    """A deep copy of ``value`` whose tensors are detached CPU copies (never views of the originals).

    Dicts, lists and tuples are copied element by element; anything else is ``copy.deepcopy``-ed.
    The result shares no storage with ``value``, so it may be written while training mutates
    the originals.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        out = {k: snapshot_to_cpu(v) for k, v in value.items()}
        if isinstance(value, OrderedDict):  # a module's state_dict: keep its version metadata
            out = OrderedDict(out)
            if hasattr(value, "_metadata"):
                out._metadata = copy.deepcopy(value._metadata)  # type: ignore[attr-defined]
        return out
    if type(value) in (list, tuple):
        return type(value)(snapshot_to_cpu(v) for v in value)
    return copy.deepcopy(value)


class BackgroundWriter:
    """Writes submitted snapshots atomically on one worker thread, newest first, one at a time.

    The caller must not mutate a submitted object afterwards (give it a
    :func:`snapshot_to_cpu` copy). One writer serves any number of paths; per path only the
    newest waiting snapshot is kept.
    """

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._pending: dict[Path, Any] = {}
        self._busy = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.writes = 0
        """Files written so far (each a complete commit)."""

    def submit(self, obj: Any, path: str | os.PathLike[str]) -> None:
        """Queue ``obj`` for ``path`` (replacing a waiting one) and return at once.

        Raises:
            PersistError: an earlier background write failed (its error is the cause).
        """
        with self._lock:
            self._raise_error()
            self._pending[Path(path)] = obj
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="hvd-elastic-persist", daemon=False)
                self._thread.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted snapshot is on disk; return ``False`` on ``timeout`` (s).

        Raises:
            PersistError: a background write failed.
        """
        with self._lock:
            done = self._lock.wait_for(lambda: not self._pending and not self._busy, timeout)
            self._raise_error()
            return done

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise PersistError(
                f"writing an elastic commit in the background failed: {error!r}. HINT: check free space "
                "and permissions of the checkpoint directory; the previous complete commit is kept."
            ) from error

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._busy = False
                    self._thread = None
                    self._lock.notify_all()
                    return
                path = next(iter(self._pending))
                obj = self._pending.pop(path)
                self._busy = True
            try:
                atomic_save(obj, path)
                self.writes += 1
            except BaseException as error:  # kept for the caller: a thread cannot raise into it
                with self._lock:
                    self._error = error

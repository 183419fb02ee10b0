"""Chrome-trace timeline of collectives (Horovod's ``HOROVOD_TIMELINE``), written on rank 0.

The file is a JSON object ``{"traceEvents": [...]}`` of complete events (``"ph": "X"``, times
in microseconds) that chrome://tracing and https://ui.perfetto.dev load. One row (``tid``) per
collective name; each collective contributes one event per phase:

* ``check``: the cross-rank signature exchange (only for a new signature);
* ``queue``: from the call until the transport has the operation;
* the transport phase (``allreduce``, ``allgather``, ...): from launch until completion is seen;
* ``wait``: time the caller spent blocked waiting for completion.

``args`` carry ``bytes`` (payload of this rank) and ``seq`` (the collective's index).
The file is rewritten, complete and valid, every ``flush_every`` events, on :meth:`close` and at
interpreter exit. ``HOROVOD_TIMELINE=<file>`` records from ``init()`` on; :func:`start_timeline` and
:func:`stop_timeline` switch recording on and off while the job runs.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import warnings
from typing import Any

from hvd_trainer.comm.errors import CommTypeError
from hvd_trainer.comm.fatal import flush_before_hard_exit
from hvd_trainer.comm.world import get_world

__all__ = ["Timeline", "start_timeline", "stop_timeline"]


class Timeline:
    """Collects events in memory and writes them as Chrome-trace JSON.

    Args:
        path: output file (parent directories are created).
        flush_every: rewrite the file after this many new events.
    """

    def __init__(self, path: str, *, flush_every: int = 1000) -> None:
        self.path = path
        self.flush_every = flush_every
        self._events: list[dict[str, Any]] = []
        self._tids: dict[str, int] = {}
        self._unflushed = 0
        self._lock = threading.Lock()
        self._origin = time.perf_counter()
        self._closed = False
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self.flush()
        # Also write at exit: most scripts never call hvd.shutdown(), and Lightning does not.
        atexit.register(self.flush)
        flush_before_hard_exit(self.flush)

    def now_us(self) -> float:
        """Microseconds since the timeline started (the clock of every event)."""
        return (time.perf_counter() - self._origin) * 1e6

    def event(self, name: str, phase: str, start_us: float, end_us: float, **args: Any) -> None:
        """Record one complete event of ``name`` in ``phase`` from ``start_us`` to ``end_us``."""
        with self._lock:
            tid = self._tids.setdefault(name, len(self._tids) + 1)
            self._events.append(
                {
                    "name": phase,
                    "cat": "collective",
                    "ph": "X",
                    "ts": round(start_us, 3),
                    "dur": round(max(end_us - start_us, 0.0), 3),
                    "pid": 0,
                    "tid": tid,
                    "args": {"tensor": name, **args},
                }
            )
            self._unflushed += 1
            due = self._unflushed >= self.flush_every
        if due:
            self.flush()

    def flush(self) -> None:
        """Rewrite the whole file (atomically, via a temporary file). No-op once closed."""
        with self._lock:
            if self._closed:
                return
            meta = [
                {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
                for name, tid in self._tids.items()
            ]
            doc = {"traceEvents": meta + list(self._events), "displayTimeUnit": "ms"}
            self._unflushed = 0
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(doc, fh)
        os.replace(tmp, self.path)

    def close(self) -> None:
        """Write the final file; later events and flushes are ignored (the file stays as is,
        even if a new timeline reuses the path)."""
        self.flush()
        with self._lock:
            self._closed = True
        atexit.unregister(self.flush)


def start_timeline(file_path: str | os.PathLike[str], mark_cycles: bool = False) -> None:
    """Start writing the Chrome-trace timeline of every collective to ``file_path``.

    Call it on every rank, like Horovod; rank 0 writes the file (creating parent folders) and
    the other ranks record nothing. The file is valid JSON from the start and is rewritten
    as events arrive, on :func:`stop_timeline` and at exit. A timeline already running (from
    ``HOROVOD_TIMELINE`` or an earlier call) is closed first. Collectives already in flight
    when it starts are not recorded.

    Args:
        file_path: output file, e.g. ``"timeline.json"``.
        mark_cycles: accepted for Horovod compatibility. hvd_trainer has no background
            negotiation cycle to mark, so ``True`` only warns.

    Raises:
        NotInitializedError: before ``init()``. CommTypeError: ``file_path`` is not a path.
    """
    runtime = get_world().runtime
    if not isinstance(file_path, str | os.PathLike) or not os.fspath(file_path):
        raise CommTypeError(
            f"start_timeline(file_path={file_path!r}) needs a non-empty path. "
            "HINT: hvd.start_timeline('timeline.json')."
        )
    if mark_cycles:
        warnings.warn("start_timeline(mark_cycles=True): hvd_trainer has no negotiation cycles "
                      "to mark; the timeline shows each collective's phases instead.",
                      UserWarning, stacklevel=2)
    if runtime is None:
        return
    if runtime.timeline is not None:
        runtime.timeline.close()
    runtime.set_timeline(Timeline(os.fspath(file_path)) if runtime.rank == 0 else None)


def stop_timeline() -> None:
    """Stop recording and write the timeline file (a no-op when none is running).

    Raises:
        NotInitializedError: before ``init()``.
    """
    runtime = get_world().runtime
    if runtime is None or runtime.timeline is None:
        return
    runtime.timeline.close()
    runtime.set_timeline(None)

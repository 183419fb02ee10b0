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
interpreter exit.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any

from hvd_trainer.comm.fatal import flush_before_hard_exit

__all__ = ["Timeline"]


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
        """Rewrite the whole file (atomically, via a temporary file)."""
        with self._lock:
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
        """Write the final file."""
        self.flush()

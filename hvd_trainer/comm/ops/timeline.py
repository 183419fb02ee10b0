"""Chrome-trace timeline of collectives (Horovod's ``HOROVOD_TIMELINE``), written by every rank.

The file is a JSON object ``{"displayTimeUnit": "ms", "traceEvents": [...]}`` of complete
events (``"ph": "X"``, times in microseconds) that chrome://tracing and https://ui.perfetto.dev
load. One row (``tid``) per collective, named like Horovod's operations
(``"<kind>.<tensor name>"``, e.g. ``allreduce.loss``; ``allreduce.noname`` for unnamed ones);
each collective contributes one event per phase:

* ``check``: the cross-rank signature exchange (only for a new signature; Horovod's
  ``NEGOTIATE_<KIND>``);
* ``queue``: from the call until the transport has the operation;
* the transport phase (``allreduce``, ``allgather``, ...): from launch until completion is seen;
* ``wait``: time the caller spent blocked waiting for completion.

``args`` carry ``tensor`` (the name given, else the kind), ``activity`` (Horovod's upper-case
activity name: ``NEGOTIATE_ALLREDUCE``, ``QUEUE``, ``ALLREDUCE``, ``WAIT_FOR_DATA``), ``bytes``
(payload of this rank) and ``seq`` (the collective's index).

Events reach the file as they are recorded (every ``flush_every`` events, default each one),
so the trace can be read while the job runs. The file is append-only and closed after every
write (the final ``]}`` is written again after the new events), so it parses as JSON between
writes and writing costs the same at the millionth event as at the first; a reader that races
a write may see one half-written event (as with Horovod's unterminated array).
``HOROVOD_TIMELINE=<file>`` records from ``init()`` on; :func:`start_timeline` and
:func:`stop_timeline` switch recording on and off while the job runs.

Every rank records its own view: rank 0 into ``<file>`` (as Horovod), rank ``r`` into
``<stem>.rank<r><suffix>`` next to it (:func:`rank_path`), each file a complete trace whose
events carry ``"pid": r`` (a ``process_name`` metadata event names it ``rank r`` and records
the file's clock origin as ``origin_epoch_us``). :func:`merge_timelines` puts them into one file
on a common clock: one process per rank, one row per collective (a fused gradient bucket is one
collective, so one row per bucket) in Perfetto and chrome://tracing.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import warnings
from typing import Any

from hvd_trainer.comm.base.errors import CommTypeError
from hvd_trainer.comm.base.fatal import flush_before_hard_exit
from hvd_trainer.comm.world.world import get_world

__all__ = ["Timeline", "start_timeline", "stop_timeline", "activity_name", "rank_path", "merge_timelines"]

_HEAD = '{"displayTimeUnit": "ms", "traceEvents": [\n'
_TAIL = "\n]}\n"

_ACTIVITY = {"check": "NEGOTIATE_{KIND}", "queue": "QUEUE", "wait": "WAIT_FOR_DATA"}


def activity_name(phase: str, kind: str) -> str:
    """Horovod's activity name of ``phase`` of a ``kind`` collective (``"check"``,
    ``"allreduce"`` -> ``"NEGOTIATE_ALLREDUCE"``; the transport phase -> ``"ALLREDUCE"``)."""
    return _ACTIVITY.get(phase, phase.upper()).format(KIND=kind.upper())


def rank_path(path: str, rank: int) -> str:
    """The timeline file of ``rank``: ``path`` itself for rank 0, else ``<stem>.rank<r><suffix>``
    (``/tmp/timeline.json``, 1 -> ``/tmp/timeline.rank1.json``)."""
    if rank == 0:
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.rank{rank}{suffix}"


class Timeline:
    """Appends events to a Chrome-trace JSON file that stays valid between writes.

    Args:
        path: output file (parent directories are created; an existing file is replaced).
        flush_every: write after this many new events (1: each event reaches the file at
            once; events still buffered are written by :meth:`flush`, :meth:`close` and at exit).
        rank: the recording rank: the ``pid`` of every event (one process per rank once merged).
    """

    def __init__(self, path: str, *, flush_every: int = 1, rank: int = 0) -> None:
        self.path = path
        self.flush_every = max(1, int(flush_every))
        self.rank = rank
        self._lock = threading.Lock()
        self._origin = time.perf_counter()
        # The wall clock at the origin, so merge_timelines can align the ranks' files; written
        # with the first event (a timeline that records nothing stays an empty trace).
        self._process_event: dict[str, Any] | None = {
            "name": "process_name", "ph": "M", "pid": rank,
            "args": {"name": f"rank {rank}", "origin_epoch_us": round(time.time() * 1e6, 1)},
        }
        self._pending: list[dict[str, Any]] = []
        self._tids: dict[str, int] = {}
        self._closed = False
        self._empty = True
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self._fh = open(path, "wb")  # noqa: SIM115 - open for the timeline's life
        self._fh.write((_HEAD + _TAIL).encode())
        self._fh.flush()
        # Also write at exit: most scripts never call hvd.shutdown(), and Lightning does not.
        atexit.register(self.flush)
        flush_before_hard_exit(self.flush)

    def now_us(self) -> float:
        """Microseconds since the timeline started (the clock of every event)."""
        return (time.perf_counter() - self._origin) * 1e6

    def event(
        self, name: str, phase: str, start_us: float, end_us: float, *, row: str | None = None,
        **args: Any,
    ) -> None:
        """Record one complete event of tensor ``name`` in ``phase`` from ``start_us`` to
        ``end_us`` on the row ``row`` (default: ``name``); ``args`` go to the event's args."""
        label = name if row is None else row
        with self._lock:
            if self._closed:
                return
            if self._process_event is not None:
                self._pending.append(self._process_event)
                self._process_event = None
            tid = self._tids.get(label)
            if tid is None:
                tid = self._tids[label] = len(self._tids) + 1
                self._pending.append(
                    {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": label}}
                )
            self._pending.append(
                {
                    "name": phase,
                    "cat": "collective",
                    "ph": "X",
                    "ts": round(start_us, 3),
                    "dur": round(max(end_us - start_us, 0.0), 3),
                    "pid": self.rank,
                    "tid": tid,
                    "args": {"tensor": name, **args},
                }
            )
            if len(self._pending) >= self.flush_every:
                self._write_pending()

    def flush(self) -> None:
        """Write the buffered events. No-op once closed."""
        with self._lock:
            if not self._closed:
                self._write_pending()

    def _write_pending(self) -> None:
        """Append the buffered events over the closing ``]}`` and close the JSON again."""
        if not self._pending:
            return
        text = ",\n".join(json.dumps(e) for e in self._pending)
        self._pending.clear()
        self._fh.seek(-len(_TAIL), os.SEEK_END)
        self._fh.write((("" if self._empty else ",\n") + text + _TAIL).encode())
        self._fh.flush()
        self._empty = False

    def close(self) -> None:
        """Write what is buffered and close the file; later events and flushes are ignored
        (the file stays as is, even if a new timeline reuses the path)."""
        with self._lock:
            if self._closed:
                return
            self._write_pending()
            self._closed = True
            self._fh.close()
        atexit.unregister(self.flush)


def start_timeline(file_path: str | os.PathLike[str], mark_cycles: bool = False) -> None:
    """Start writing the Chrome-trace timeline of every collective to ``file_path``.

    Call it on every rank, like Horovod; rank 0 writes ``file_path`` (creating parent folders)
    and rank ``r`` its own ``rank_path(file_path, r)`` (see :func:`merge_timelines`). Each file
    is valid JSON from the start and each event reaches it as it is recorded. A timeline
    already running (from ``HOROVOD_TIMELINE`` or an earlier call) is closed first.
    Collectives already in flight when it starts are not recorded.

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
    path = rank_path(os.fspath(file_path), runtime.rank)
    runtime.set_timeline(Timeline(path, rank=runtime.rank))


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


def _read_events(path: str) -> list[dict[str, Any]]:
    """The events of one timeline file; a file cut in the middle of a write loses its last event."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        return list(json.loads(text)["traceEvents"])
    except (json.JSONDecodeError, KeyError, TypeError):
        body = text[len(_HEAD):].rsplit("},\n", 1)[0] + "}"
        return list(json.loads("[" + body + "]"))


def merge_timelines(path: str, size: int, out: str | None = None) -> str:
    """Merge the timeline files of ranks ``0 .. size - 1`` (``rank_path(path, r)``) into one.

    Each rank's times are shifted by the difference of its clock origin to the earliest rank's
    (read from its ``process_name`` event), so events of all ranks share one clock starting near
    0: the wall clocks of the hosts, aligned as well as they are (exact on one host). A rank
    whose file is missing is left out.

    Args:
        path: rank 0's file (the ``HOROVOD_TIMELINE`` value).
        size: number of ranks.
        out: the merged file (default ``path``: rank 0's own file is replaced; stop recording
            first, e.g. with :func:`stop_timeline`, so rank 0 does not write it meanwhile).

    Returns:
        The merged file's path. Raises ``FileNotFoundError`` when rank 0's file is missing.
    """
    per_rank = {r: _read_events(rank_path(path, r)) for r in range(size)
                if r == 0 or os.path.exists(rank_path(path, r))}
    origins = {r: _origin_us(events) for r, events in per_rank.items()}
    base = min(origins.values())
    merged: list[dict[str, Any]] = []
    for r, events in per_rank.items():
        shift = origins[r] - base
        for event in events:
            if "ts" in event:
                event = {**event, "ts": round(event["ts"] + shift, 3)}
            merged.append(event)
    target = out or path
    tmp = f"{target}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(_HEAD + ",\n".join(json.dumps(e) for e in merged) + _TAIL)
    os.replace(tmp, target)
    return target


def _origin_us(events: list[dict[str, Any]]) -> float:
    for event in events:
        if event.get("name") == "process_name" and "origin_epoch_us" in event.get("args", {}):
            return float(event["args"]["origin_epoch_us"])
    return 0.0

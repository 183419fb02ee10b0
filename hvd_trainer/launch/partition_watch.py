"""Stop hvdrun when its workers found a network partition and torchrun's agent cannot stop.

On the far side of a cut link, torchrun's agent is itself blocked on the unreachable store
(its monitor loop asks the rendezvous how many nodes wait, its shutdown closes the rendezvous),
for minutes. The workers there notice the partition through their heartbeat
(:mod:`hvd_trainer.comm.world.heartbeat`) and leave a record ``unreachable.<rank>.json`` in the job
directory. :class:`PartitionWatch` polls that directory from a daemon thread; once a record is
older than ``grace_seconds`` and hvdrun has still not finished, it prints one line naming what
the worker could not reach, kills every process hvdrun started (the agent's workers run in their
own sessions, so they are found through their parent pids) and ends hvdrun with status 1. An
agent that restarts its workers (elastic) is not stuck: it forgets the records
(:func:`forget_partition_records`, called by :class:`~hvd_trainer.launch.agent_watch.AgentWatch`).

:func:`partition_line` is the same line, used by hvdrun's normal failure report when the agent
did stop (the near side).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hvd_trainer.comm import UNREACHABLE_RECORD, read_records

__all__ = ["PartitionWatch", "partition_line", "descendants", "forget_partition_records"]


def partition_line(records: list[dict[str, Any]]) -> str | None:
    """``hvdrun: error: ...`` for the first partition record, ``None`` without one."""
    if not records:
        return None
    first = records[0]
    others = sorted({int(r.get("rank", 0)) for r in records[1:]})
    also = f" (ranks {', '.join(map(str, others))} found it too)" if others else ""
    return f"hvdrun: error: network partition: {first.get('message', '')}{also}"


def forget_partition_records(job_dir: Path) -> None:
    """Delete the partition records (the agent is restarting its workers, so it is not stuck)."""
    for path in job_dir.glob(UNREACHABLE_RECORD.format(rank="*")):
        with contextlib.suppress(OSError):
            path.unlink()


def _parent_pids() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{entry}/stat") as fh:
            parents[int(entry)] = int(fh.read().rpartition(")")[2].split()[1])
    return parents


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first found, then theirs), from ``/proc``."""
    parents = _parent_pids()
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier and c not in found]
        found.extend(children)
        frontier = children
    return found


class PartitionWatch:
    """Poll ``job_dir`` for partition records while hvdrun's agent runs (see module docstring).

    Args:
        job_dir: hvdrun's ``HVDRUN_JOB_DIR``.
        grace_seconds: how long the agent may take to stop by itself after the first record.
        hard_exit: ends hvdrun (tests pass their own).
    """

    def __init__(self, job_dir: Path, grace_seconds: float = 5.0,
                 hard_exit: Callable[[int], None] = os._exit) -> None:
        self.job_dir, self.grace_seconds, self._hard_exit = job_dir, grace_seconds, hard_exit
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvdrun-partition-watch", daemon=True)

    def __enter__(self) -> PartitionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)  # done reading before the job directory is removed

    def _loop(self) -> None:
        first_seen: float | None = None
        while not self._done.wait(0.2):
            records = read_records(self.job_dir)
            if not records:  # none yet, or the agent restarted the workers (records forgotten)
                first_seen = None
                continue
            first_seen = first_seen or time.monotonic()
            if time.monotonic() - first_seen >= self.grace_seconds:
                self._stop_job(records)
                return

    def _stop_job(self, records: list[dict[str, Any]]) -> None:
        line = partition_line(records) or ""
        print(f"{line}; torchrun's agent could not stop (it waits on the unreachable store), so "
              "hvdrun killed this host's workers.", file=sys.stderr, flush=True)
        for pid in descendants(os.getpid()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.job_dir, ignore_errors=True)  # the with-block that owns it never ends
        self._hard_exit(1)

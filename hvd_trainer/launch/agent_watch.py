"""Watch torchrun's elastic agent: announce restarts, and stop instead of retrying a user error.

torchrun's agent restarts all workers after any failure, silently. hvdrun runs the agent in
its own process and wraps the agent's monitor step (``LocalElasticAgent._monitor_workers``,
torch's private API, checked by :func:`watch_supported`) while the job runs. When a check
finds failed workers:

* a worker recorded a user error (``<job dir>/user_error.<rank>.json``, written by
  :mod:`hvd_trainer.elastic.user_error`; the job dir is ``HVDRUN_JOB_DIR``): the agent's
  remaining restarts are set to 0, so it stops the workers and reports the failure, and hvdrun
  ends with that worker's status and the exception's text;
* otherwise, with restarts left: one line ``hvdrun: rank R (...) failed with ...; restarting
  all workers (attempt k of n)``.

With in-process recovery every monitor step also forwards the worker entry's ``lost.<rank>``
records (a worker process killed and being started again) to the workers' store
(:func:`~hvd_trainer.comm.world.quorum.gone_key`): the ranks on other hosts, which cannot see
this host's processes, then re-form without waiting for it.

An agent whose workers failed for good (no restart left) also leaves a mark in the
rendezvous store (:data:`FAILED_AGENT_KEY`). torchrun's agent whose workers all finished waits in
an exit barrier for every other agent (up to 300 s); a failed agent never arrives there, so the
wrapped barrier first polls, every :data:`BARRIER_POLL_SECONDS`, for either every agent's
"finished" count or that mark, and with the mark leaves at once, naming the failed host.

:meth:`AgentWatch.summary` is the closing line about the restarts used.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from torch.distributed import TCPStore

from hvd_trainer.comm import gone_key
from hvd_trainer.launch.failures import describe_exit, root_failure, script_pid
from hvd_trainer.launch.partition_watch import forget_partition_records

__all__ = ["AgentWatch", "read_user_errors", "watch_supported", "FAILED_AGENT_KEY", "FINISHED_AGENTS_KEY"]

FAILED_AGENT_KEY = "hvdrun/agent_failed"
"""Set (to the host's name) by an agent whose workers failed and will not be restarted; in the
rendezvous round's own store, so a later round starts clean."""
FINISHED_AGENTS_KEY = "hvdrun/agents_finished"
"""Counted up by each agent whose workers all finished."""
BARRIER_POLL_SECONDS = 0.2


def read_user_errors(job_dir: Path) -> list[dict[str, Any]]:
    """The user-error records in ``job_dir``, lowest rank first (see the module docstring)."""
    records = []
    for path in sorted(job_dir.glob("user_error.*.json")):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    return sorted(records, key=lambda r: int(r.get("rank", 0)))


def _own_errors(records: list[dict[str, Any]], failures: dict[int, Any]) -> list[dict[str, Any]]:
    """The records that explain this failure: none when a worker was killed by a signal other
    than the agent's own SIGTERM (SIGKILL, SIGSEGV, OOM...). Its peers then fail in whatever
    call they were in, and may record that as their own error; the job is restarted, as Horovod
    restarts after a lost rank. (torchrun's timestamps are whole seconds, so order alone cannot
    tell which came first.)"""
    killed = [f for f in failures.values() if f.exitcode < 0 and f.exitcode != -signal.SIGTERM]
    return [] if killed else records


def _mark_failed(agent: Any) -> None:
    """Leave :data:`FAILED_AGENT_KEY` in the agent's rendezvous store (never raises)."""
    with contextlib.suppress(Exception):
        agent._store.set(FAILED_AGENT_KEY, socket.gethostname())


def _forget(job_dir: Path) -> None:
    for path in job_dir.glob("user_error.*.json"):
        with contextlib.suppress(OSError):
            path.unlink()


def _agent_class() -> Any:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    return LocalElasticAgent


def watch_supported() -> bool:
    """Whether this torch's agent has the monitor step and restart counter the watch uses."""
    agent = _agent_class()
    codes = [getattr(vars(cls).get("__init__"), "__code__", None) for cls in agent.__mro__]
    sets_counter = any(code is not None and "_remaining_restarts" in code.co_names for code in codes)
    return hasattr(agent, "_monitor_workers") and sets_counter


class AgentWatch:
    """Restart bookkeeping of one hvdrun job.

    Args:
        job_dir: the directory exported to workers as ``HVDRUN_JOB_DIR``.
        max_restarts: ``--max-restarts`` of the job (the ``n`` of "attempt k of n").
        out: where announcements go (hvdrun's stderr).
        exit_barrier_seconds: the agent's wait for the other agents once its workers finished
            (torch's ``_exit_barrier_timeout``; ``None``: leave torchrun's 300 s).
        respawn_budget: with in-process recovery, how often each lost worker may be started
            again alone (``HVDRUN_RESPAWNS``; 0: the job restarts all workers instead).
    """

    def __init__(self, job_dir: Path, max_restarts: int, out: TextIO | None = None,
                 exit_barrier_seconds: float | None = None, respawn_budget: int = 0) -> None:
        self.job_dir, self.max_restarts = job_dir, max_restarts
        self.respawn_budget = respawn_budget
        self.exit_barrier_seconds = exit_barrier_seconds
        self.out = out or sys.stderr
        self.restarts_used = 0
        self.user_error: dict[str, Any] | None = None
        self._reported: set[tuple[int, int]] = set()
        self._client: tuple[tuple[str, int], Any] | None = None

    def on_failure(self, agent: Any, failures: dict[int, Any]) -> None:
        """Called by the wrapped monitor step when it found failed workers."""
        records = _own_errors(read_user_errors(self.job_dir), failures)
        if records:
            self.user_error = records[0]
            agent._remaining_restarts = 0  # torch's agent then stops the workers and reports
            _mark_failed(agent)
            return
        _forget(self.job_dir)  # a record written because a peer died must not stop the next attempt
        if agent._remaining_restarts <= 0 or not failures:
            _mark_failed(agent)
            return
        forget_partition_records(self.job_dir)  # this agent is not stuck: it restarts the workers
        self.restarts_used += 1
        rank, first = root_failure(failures)[0]
        pid = script_pid(self.job_dir, rank, first.pid)
        print(f"hvdrun: rank {rank} (local rank {first.local_rank}, pid {pid}) failed with "
              f"{describe_exit(first.exitcode)}; restarting all workers "
              f"(attempt {self.restarts_used} of {self.max_restarts})", file=self.out, flush=True)

    def report_lost(self, agent: Any) -> None:
        """Write each new ``lost.<rank>`` record of the job directory into the workers' store
        (``MASTER_ADDR:MASTER_PORT`` of the agent's worker group, a client opened once) as
        :func:`~hvd_trainer.comm.world.quorum.gone_key` (rank = launch slot). Silent when that
        store cannot be reached within 5 s (each record is tried once): the other ranks then wait
        their settle time instead."""
        new = []
        for path in self.job_dir.glob("lost.*"):
            rank = path.name.split(".", 1)[1]
            with contextlib.suppress(OSError, ValueError):
                record = (int(rank), int(path.read_text()))
                if record not in self._reported:
                    new.append(record)
        if not new:
            return
        self._reported.update(new)  # tried once: a store out of reach must not stall every monitor step
        with contextlib.suppress(Exception):  # noqa: BLE001 - the store's host may be gone
            group = agent._worker_group
            run_id = group.spec.rdzv_handler.get_run_id()
            store = self._workers_store(group.master_addr, int(group.master_port))
            for rank, pid in new:
                store.set(gone_key(run_id, rank, pid), socket.gethostname())

    def _workers_store(self, host: str, port: int) -> Any:
        if self._client is None or self._client[0] != (host, port):
            client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
            self._client = ((host, port), client)
        return self._client[1]

    def await_agents(self, agent: Any) -> bool:
        """Before torch's exit barrier: count this agent finished, then wait until every agent
        finished (``True``: torch's barrier then passes at once) or one left the failed mark
        (``False``: the barrier is skipped, a line names the host). Bounded by the agent's
        barrier timeout, after which the barrier is skipped with a line too (torch's would wait
        that long again, then log a traceback; an agent that never came is a host that left the
        job); a lost store skips the barrier too (torch's would fail at once)."""
        try:
            store, agents = agent._store, int(agent._worker_group.group_world_size)
            store.add(FINISHED_AGENTS_KEY, 1)
            waited, finished = float(agent._exit_barrier_timeout), 0
            deadline = time.monotonic() + waited
            while time.monotonic() < deadline:
                if store.check([FAILED_AGENT_KEY]):
                    host = bytes(store.get(FAILED_AGENT_KEY)).decode(errors="replace")
                    print(f"hvdrun: the workers on host {host} failed; this host's workers finished, "
                          "so hvdrun stops now instead of waiting for that host's agent.",
                          file=self.out, flush=True)
                    return False
                finished = int(store.add(FINISHED_AGENTS_KEY, 0))
                if finished >= agents:
                    return True
                time.sleep(BARRIER_POLL_SECONDS)  # two keys on a remote store: polled
        except Exception:  # noqa: BLE001 - the store's host is gone: nobody to wait for
            return False
        print(f"hvdrun: {agents - finished} of the {agents} hosts' agents did not finish within {waited:g} s "
              "of this one (a host that left the job); this host's workers finished, so hvdrun ends now.",
              file=self.out, flush=True)
        return False

    def summary(self) -> str | None:
        """The closing line: ``hvdrun: 1 of 3 restarts used.``, or with in-process recovery
        ``hvdrun: 2 lost workers started again in process (rank 1: 2; at most 3 per rank).``;
        ``None`` when neither applies."""
        if self.respawn_budget > 0:
            counts: dict[str, int] = {}
            for path in self.job_dir.glob("respawns.*"):
                rank = path.name.split(".", 1)[1]
                with contextlib.suppress(OSError, ValueError):
                    if rank.isdigit():
                        counts[rank] = int(path.read_text())
            total = sum(counts.values())
            ranks = ", ".join(f"rank {r}: {n}" for r, n in sorted(counts.items(), key=lambda kv: int(kv[0])))
            return (f"hvdrun: {total} lost worker{'' if total == 1 else 's'} started again in process "
                    f"({ranks + '; ' if ranks else ''}at most {self.respawn_budget} per rank).")
        if self.max_restarts > 0:
            return f"hvdrun: {self.restarts_used} of {self.max_restarts} restarts used."
        return None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Wrap the agent's monitor step while the ``with`` block runs (a no-op if unsupported)."""
        if not watch_supported():
            yield
            return
        from torch.distributed.elastic.agent.server.api import WorkerState

        agent_cls = _agent_class()
        original = agent_cls._monitor_workers
        watch = self

        def monitor(agent: Any, worker_group: Any) -> Any:
            if watch.exit_barrier_seconds is not None:
                agent._exit_barrier_timeout = watch.exit_barrier_seconds
            result = original(agent, worker_group)
            if watch.respawn_budget > 0:
                watch.report_lost(agent)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                watch.on_failure(agent, result.failures)
            return result

        original_barrier = getattr(agent_cls, "_exit_barrier", None)

        def exit_barrier(agent: Any) -> Any:
            if watch.await_agents(agent):
                return original_barrier(agent)
            return None

        agent_cls._monitor_workers = monitor
        if original_barrier is not None:
            agent_cls._exit_barrier = exit_barrier
        try:
            yield
        finally:
            agent_cls._monitor_workers = original
            if original_barrier is not None:
                agent_cls._exit_barrier = original_barrier

"""Notice a network partition within seconds: a heartbeat per rank over the job's store.

A cut link gives gloo nothing to report: no connection closes, every send just waits, and the
process group's own timeout is 10 minutes. So every rank of a job that spans several hosts runs
two daemon threads:

1. the *beater* (``hvd-heartbeat``) opens its own client connection to the job's store (the
   ``MASTER_ADDR:MASTER_PORT`` TCPStore, so it never queues behind the main thread's store
   calls) and, every ``interval_seconds``, writes ``<count>|<host>|<pid>`` under its rank, then
   reads every rank's entry (``check`` + ``multi_get``: two round trips, whatever the size);
2. the *judge* (``hvd-peer-judge``) never touches the network. It decides, from the times the
   beater last completed a round and last saw each peer's count change, read on this process's
   :class:`AwakeClock` (clocks of different hosts never matter, and time this process itself
   did not run, frozen or starved of CPU, is not counted as anybody's silence):

   * this rank has not completed a round for ``timeout_seconds``: it is cut off from the
     store's host (the far side of a partition);
   * a peer's count has not changed for ``timeout_seconds`` (and it did not stop cleanly):
     that peer's host is unreachable, or the process is frozen.

A store call that *fails* because the store's process ended (the connection closed, and a new one
is refused: e.g. rank 0 hosting it finished first) is no partition: the watch ends quietly and the
dead-rank checks of :mod:`~hvd_trainer.comm.ops.checks` report it. A call that times out is
silence: the beater connects again and the judge goes on measuring. The judge's first finding is
kept as :attr:`PeerWatch.failure`. A rank blocked in a gloo collective polls it every few
milliseconds (``Coordinator._guarded_wait``) and raises
:class:`~hvd_trainer.comm.base.errors.HostUnreachableError`. A rank stuck where it cannot poll
(a store call to the unreachable host, an NCCL wait) is ended by the judge after
``grace_seconds``: it prints the message and leaves with
:data:`~hvd_trainer.comm.base.fatal.PEER_FAILED_EXIT_CODE`. Either way a record
``unreachable.<rank>.json`` is written to hvdrun's job directory (``HVDRUN_JOB_DIR``), so hvdrun
can stop even when torchrun's agent is itself stuck on the unreachable store; before raising, a
rank marks its record "raising" and waits (bounded) until the other ranks on its host are raising
too, so each prints its own error before the launcher stops them.

Cost: the main thread reads one attribute per poll; the threads make three store round trips
per interval on their own connection. ``bench/heartbeat_overhead.py`` (2 namespace hosts x 2
processes, 1 MiB allreduce steps) found the step time with and without it within run-to-run
noise (``RATIO heartbeat_on_vs_off=0.906``, medians 13.9 ms on / 15.3 ms off, runs 11.5-17.0 ms).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hvd_trainer.comm.base.errors import HostUnreachableError
from hvd_trainer.comm.base.fatal import PEER_FAILED_EXIT_CODE, pid_alive

__all__ = [
    "PeerWatch", "PeerState", "Failure", "UNREACHABLE_RECORD", "TIMEOUT_ENV", "read_records",
    "judge", "interval_for", "AwakeClock",
]

TIMEOUT_ENV = "HOROVOD_GLOO_TIMEOUT_SECONDS"
"""Seconds of silence after which a peer (or the store) counts as unreachable; 0 disables."""

UNREACHABLE_RECORD = "unreachable.{rank}.json"
"""File name of the record a rank leaves in ``HVDRUN_JOB_DIR`` when it found a partition."""

_STOPPED = "stopped"


class AwakeClock:
    """Seconds this process was awake to see: ``time.monotonic()``, except that a gap between two
    readings (from any thread) longer than ``max_step`` counts as ``max_step``.

    A process that was frozen (``SIGSTOP``, a paused VM) or starved of CPU saw nothing meanwhile;
    on the monotonic clock its first reading after it runs again makes every peer and the store
    look silent for the whole freeze. On this clock the freeze counts as ``max_step`` at most,
    so silence is measured only over time the process could have heard it. A watch reads its
    clock every 0.1 s while it runs; ``max_step`` is its round interval (0.2-2 s): a real cut is
    still found after ``timeout_seconds`` plus at most one interval per freeze. Thread-safe.
    """

    def __init__(self, max_step: float) -> None:
        if not max_step > 0:
            raise ValueError(f"max_step={max_step} must be > 0 (seconds).")
        self.max_step = max_step
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._awake = 0.0

    def read(self) -> float:
        """The awake time now, in seconds (non-decreasing; its origin is arbitrary)."""
        with self._lock:
            now = time.monotonic()
            self._awake += min(now - self._last, self.max_step)
            self._last = now
            return self._awake


def interval_for(timeout_seconds: float) -> float:
    """Seconds between two heartbeat rounds: a tenth of the timeout, within [0.2, 2] s."""
    return max(0.2, min(2.0, timeout_seconds / 10))


@dataclass(slots=True)
class PeerState:
    """What this rank last heard from one peer (times: its watch's :class:`AwakeClock`)."""

    host: str = "?"
    pid: int = 0
    count: str = ""
    changed_at: float = 0.0
    stopped: bool = False


@dataclass(frozen=True, slots=True)
class Failure:
    """A partition found by the judge: the message and whom it names."""

    message: str
    hosts: tuple[str, ...]
    ranks: tuple[int, ...]
    found_at: float = field(default=0.0, compare=False)
    cut_off: bool = False
    """This rank cannot reach the job's store (it is on the far side of the partition)."""

    def error(self) -> HostUnreachableError:
        return HostUnreachableError(self.message)


def _ranks_by_host(peers: dict[int, PeerState], ranks: Sequence[int]) -> str:
    hosts: dict[str, list[int]] = {}
    for r in ranks:
        hosts.setdefault(peers[r].host if r in peers else "?", []).append(r)
    return ", ".join(f"{h} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                     for h, rs in hosts.items())


def judge(
    *, now: float, last_round_at: float, peers: dict[int, PeerState], me: int, my_host: str,
    store_addr: str, timeout_seconds: float,
) -> Failure | None:
    """The partition visible at ``now``, if any (pure: every time is passed in).

    Args:
        now: the time, in seconds, on the clock of every other time passed (a watch passes its
            :class:`AwakeClock`'s). last_round_at: when this rank last completed a heartbeat
            round. peers: every other rank's state. me, my_host: this rank.
        store_addr: ``host:port`` of the job's store. timeout_seconds: the allowed silence.
    """
    hint = (f"HINT: check the network between the hosts (cable, switch, firewall: the store port "
            f"and gloo's ports must be open both ways); {TIMEOUT_ENV} (hvdrun "
            f"--gloo-timeout-seconds) sets how long a peer may be silent.")
    quiet = now - last_round_at
    if quiet >= timeout_seconds:
        others = sorted(r for r in peers if peers[r].host != my_host)
        hosts = tuple(dict.fromkeys([store_addr.rpartition(":")[0]] + [peers[r].host for r in others]))
        return Failure(
            f"rank {me} on {my_host} cannot reach the job's store at {store_addr} for "
            f"{quiet:.1f} s: this host is cut off from {', '.join(hosts)}"
            + (f"; unreachable: {_ranks_by_host(peers, others)}" if others else "") + f". {hint}",
            hosts, tuple(others), now, cut_off=True)
    # A peer's silence is measured at this rank's last completed round: on the far side of a
    # cut, rounds stop too, and the store (not the peers) is what cannot be reached.
    def quiet_for(p: PeerState) -> float:
        return -1.0 if p.stopped else last_round_at - p.changed_at

    if not any(quiet_for(p) >= timeout_seconds for p in peers.values()):
        return None
    # Name every peer that has been quiet for a while too: a host's ranks fall silent together,
    # but their last beats were read at slightly different times.
    silent = sorted(r for r, p in peers.items() if quiet_for(p) >= timeout_seconds / 2)
    hosts = tuple(dict.fromkeys(peers[r].host for r in silent))
    longest = max(now - peers[r].changed_at for r in silent)
    return Failure(
        f"rank {me} on {my_host} has not heard from {_ranks_by_host(peers, silent)} for "
        f"{longest:.1f} s (the limit is {timeout_seconds:g} s): the network to "
        f"{', '.join(hosts)} is cut, or the host is down or frozen. {hint}",
        hosts, tuple(silent), now)


def read_records(job_dir: Path) -> list[dict[str, Any]]:
    """The ``unreachable.<rank>.json`` records in ``job_dir``, lowest rank first (none when
    ``job_dir`` cannot be listed, e.g. hvdrun removed it at the job's end)."""
    records = []
    try:
        paths = sorted(job_dir.glob(UNREACHABLE_RECORD.format(rank="*")))
    except OSError:
        return []
    for path in paths:
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    return sorted(records, key=lambda r: int(r.get("rank", 0)))


class PeerWatch:
    """The heartbeat of one rank (see the module docstring). Thread-safe; start once, stop once.

    Args:
        store_host, store_port: the job's TCPStore (``MASTER_ADDR``, ``MASTER_PORT``).
        key_prefix: a namespace unique to this world (all ranks pass the same).
        rank, size: this rank and the world size.
        timeout_seconds: allowed silence (> 0).
        grace_seconds: how long the main thread may take to raise before the judge ends the
            process itself.
        job_dir: hvdrun's ``HVDRUN_JOB_DIR`` (``None``: write no record).
        hard_exit: ends the process (tests pass their own).
    """

    def __init__(
        self, *, store_host: str, store_port: int, key_prefix: str, rank: int, size: int,
        timeout_seconds: float, grace_seconds: float = 2.0, job_dir: str | None = None,
        hard_exit: Callable[[int], None] = os._exit,
    ) -> None:
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds={timeout_seconds} must be > 0 (0 disables the watch).")
        self.store_addr = f"{store_host}:{store_port}"
        self._endpoint = (store_host, store_port)
        self.rank, self.size = rank, size
        self.timeout_seconds, self.grace_seconds = timeout_seconds, grace_seconds
        self.interval_seconds = interval_for(timeout_seconds)
        self.clock = AwakeClock(max_step=self.interval_seconds)
        """The clock of :attr:`last_round_at`, each peer's ``changed_at`` and a failure's
        ``found_at``."""
        self._keys = [f"{key_prefix}/{r}" for r in range(size)]
        self._job_dir, self._hard_exit = job_dir, hard_exit
        self.host = socket.gethostname()
        self.peers: dict[int, PeerState] = {}
        self.failure: Failure | None = None
        self.raised = False
        """Set by the main thread once it raised :attr:`failure` (the judge then waits longer)."""
        self.last_round_at = self.clock.read()
        self._count = 0
        self._stop = threading.Event()
        self.store_gone = False
        """The store refused or closed a connection: its process ended (not a partition)."""
        self._all_seen = False
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start both daemon threads (the beater connects in its own thread)."""
        self.last_round_at = self.clock.read()
        for name, target in (("hvd-heartbeat", self._beat_loop), ("hvd-peer-judge", self._judge_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop both threads; the beater leaves the "stopped" mark under this rank (bounded wait:
        a beater blocked on an unreachable store is left behind)."""
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2.0)

    # -- the beater -----------------------------------------------------------------------
    def _connect(self) -> Any:
        host, port = self._endpoint
        wait = timedelta(seconds=min(5.0, self.timeout_seconds / 2))
        return dist.TCPStore(host, port, None, False, wait, wait_for_workers=False)

    def _beat_loop(self) -> None:
        """Beat until stopped. A store call that *fails* because the store refuses or closes
        connections (its process ended, e.g. rank 0 hosting it finished first) ends the watch
        without a report. A call that times out (a store that stalls, a cut link) does not: the
        beater connects again and beats on, and the judge measures the silence. Leaves no store
        call running at exit (a daemon thread inside one at interpreter exit aborts the process)."""
        client = None
        while not self._stop.is_set():
            try:
                if client is None:
                    # A store that ended refuses at once; TCPStore's own connect would retry a
                    # refused port for its whole timeout (and more), while the judge counts.
                    if self._store_refuses():
                        self.store_gone = True
                        return
                    client = self._connect()
                self._round(client)
            except Exception:  # noqa: BLE001 - refused, closed or timed out: the probe tells which
                client = None
                if self.failure is not None:  # judged already: nothing more to learn
                    return
                if self._store_refuses():
                    self.store_gone = True
                    return
                self._stop.wait(self.interval_seconds)
                continue
            # quick rounds until every peer has beaten once, so every host is known early
            self._stop.wait(self.interval_seconds if self._all_seen else 0.1)
        if self.failure is None and client is not None:
            with contextlib.suppress(Exception):  # the store may have ended meanwhile
                client.set(self._keys[self.rank], f"{_STOPPED}|{self.host}|{os.getpid()}")

    def _store_refuses(self) -> bool:
        """Whether the store's host answers that nothing listens on its port any more (connection
        refused: the store's process ended). A timeout or an unreachable network is silence."""
        try:
            with socket.create_connection(self._endpoint, timeout=min(5.0, self.timeout_seconds / 2)):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False

    def _round(self, client: Any) -> None:
        self._count += 1
        client.set(self._keys[self.rank], f"{self._count}|{self.host}|{os.getpid()}")
        others = [r for r in range(self.size) if r != self.rank]
        if not self._all_seen:  # until every peer has beaten once (so every host is known)
            self._all_seen = bool(client.check([self._keys[r] for r in others]))
            if not self._all_seen:
                self.last_round_at = self.clock.read()  # the store answers: not cut off
                return
        values = client.multi_get([self._keys[r] for r in others]) if others else []
        now = self.clock.read()
        for r, raw in zip(others, values, strict=True):
            self._update(r, raw.decode() if isinstance(raw, bytes) else str(raw), now)
        self.last_round_at = now

    def _update(self, rank: int, value: str, now: float) -> None:
        count, _, rest = value.partition("|")
        host, _, pid = rest.partition("|")
        state = self.peers.get(rank)
        if state is None or state.host == "?":  # first heard now
            state = self.peers[rank] = PeerState(changed_at=now)
        if count != state.count:
            state.count, state.changed_at = count, now
        state.host, state.pid, state.stopped = host or "?", int(pid or 0), count == _STOPPED

    # -- the judge ------------------------------------------------------------------------
    def _judge_loop(self) -> None:
        while not self._stop.wait(0.1) and not self.store_gone:
            if self.failure is None:
                self.failure = judge(
                    now=self.clock.read(), last_round_at=self.last_round_at, peers=dict(self.peers),
                    me=self.rank, my_host=self.host, store_addr=self.store_addr,
                    timeout_seconds=self.timeout_seconds,
                )
                if self.failure is not None:
                    self._write_record(self.failure)
                continue
            waited = self.clock.read() - self.failure.found_at
            if waited >= (self.grace_seconds * 5 if self.raised else self.grace_seconds):
                self._end_process(self.failure)
                return

    def await_local_peers(self) -> None:
        """Mark this rank as raising, then wait (bounded) until every rank on this host is raising
        too (its record says so, or its process ended), so the launcher, which stops the others
        once one rank exits, lets each of them raise and print its own error."""
        if not self._job_dir or self.failure is None:
            return
        self._write_record(self.failure, raising=True)
        local = [r for r, p in self.peers.items() if p.host == self.host]
        deadline = time.monotonic() + 2 * self.interval_seconds + 1.0
        while time.monotonic() < deadline:
            raising = {int(rec.get("rank", -1)) for rec in read_records(Path(self._job_dir))
                       if rec.get("raising")}
            if all(r in raising or not pid_alive(self.peers[r].pid) for r in local):
                time.sleep(0.5)  # the last to raise is printing its error now
                return
            time.sleep(0.05)

    def _write_record(self, failure: Failure, raising: bool = False) -> None:
        if not self._job_dir:
            return
        record = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "raising": raising,
                  "message": failure.message, "hosts": list(failure.hosts), "ranks": list(failure.ranks)}
        path = Path(self._job_dir) / UNREACHABLE_RECORD.format(rank=self.rank)
        with contextlib.suppress(OSError):
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(path)

    def forget_record(self) -> None:
        """Remove this rank's record: the rank recovered in process (its hvdrun must not stop it)."""
        if self._job_dir:
            with contextlib.suppress(OSError):
                (Path(self._job_dir) / UNREACHABLE_RECORD.format(rank=self.rank)).unlink()

    def _end_process(self, failure: Failure) -> None:
        """The main thread did not end the process: say why and leave (no store call: the store
        may be the unreachable side)."""
        with contextlib.suppress(Exception):
            print(f"hvd_trainer: HostUnreachableError: {failure.message}", file=sys.stderr, flush=True)
            sys.stdout.flush()
        self._hard_exit(PEER_FAILED_EXIT_CODE)

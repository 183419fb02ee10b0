"""Ranks agree before they communicate: cached cross-rank signature checks and stall inspection.

Mechanism (the cheapest correct one we found; cost printed by ``bench/allreduce_fusion.py``):

1. Every collective on a process set gets a sequence number ``seq`` (equal on all ranks of a
   correct program) and a :class:`Signature`: kind, name, reduce op, shape (dims after the
   first for allgather/alltoall), dtype, device type, root rank, number of splits, scale
   factors, compression, bucket layout.
2. The cache key is the pair (previous signature, this signature), so a change of call order
   is a new key too. When the key is new on this rank, the rank writes its signature to the
   job's key-value store (the ``TCPStore`` of the process group) under ``(set, seq, rank)``,
   waits for the other ranks' entries and compares them. Training repeats the same pairs every
   step, so after the first steps the check is a tuple hash and a set lookup. Entries are
   deleted once a later collective proves every rank has moved past them, and the cache holds
   at most ``CACHE_CAPACITY`` pairs, so neither the store nor the cache grows without bound.
3. A collective still running after ``suspect_after_seconds`` writes its signature under the
   same key and reads the others'. Ranks that disagree about whether a check is needed (only
   possible when their histories differ) therefore still meet: the rank in the check and the
   rank blocked in the transport both see the mismatch and raise.
4. Ranks without an entry when the wait reaches ``stall_warning_seconds`` are named in a
   warning together with the collective; after ``stall_shutdown_seconds`` a
   :class:`StallError` is raised.

5. A collective whose arguments this rank rejects locally (``Coordinator.local_checks``, e.g.
   a bool Average or bad splits on one rank only) still consumes its ``seq`` with a
   ``"skipped"`` entry, always exchanged: ranks that all raised at the same call stay in step;
   otherwise every rank raises a mismatch naming the rank that skipped, never pairing its next
   collective with another rank's pending one. A rank whose collective was already in the
   transport when a mismatch was found is out of step for good: each later collective writes an
   ``"out_of_step"`` entry and raises, so its peers raise at their next one too.

Why the store and not a collective on a side group: a store read never enters the ordered
stream of a process group, so a rank that gives up leaves no half-finished collective behind,
and one store round trip costs ~30 us where a tiny gloo allreduce costs ~500 us on a 2-core
machine. A rank that detects a mismatch waits (bounded) until every rank has seen it before
raising, so no rank is left talking to a peer that has already exited.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hvd_trainer.comm.base.config import CommConfig
from hvd_trainer.comm.base.errors import (
    CollectiveMismatchError,
    CommValueError,
    HostUnreachableError,
    JoinedRankError,
    RankFailedError,
    StallError,
)
from hvd_trainer.comm.base.fatal import PEER_FAILED_EXIT_CODE, exit_hard_at_exit
from hvd_trainer.comm.base.store import try_get
from hvd_trainer.comm.ops.timeline import Timeline, activity_name
from hvd_trainer.comm.world.heartbeat import PeerWatch
from hvd_trainer.comm.world.join_board import JoinBoard, Transport
from hvd_trainer.comm.world.liveness import (
    await_local_raising,
    describe_failure,
    describe_gone,
    find_dead_peers,
    find_gone,
    find_raising,
    finished,
    stopped_for_peers,
    wait_until_ended,
)

__all__ = ["Signature", "Op", "Coordinator", "DuplicateNameError", "REDUCING_KINDS"]

log = logging.getLogger(__name__)

REDUCING_KINDS = frozenset({"allreduce", "grouped_allreduce", "bucket"})
"""Collectives a joined rank can take part in (with zeros)."""

_RECEIVE_FROM_ALL = REDUCING_KINDS | {"allgather", "alltoall", "reducescatter", "barrier"}
"""Collectives that cannot complete on a rank before every member has entered them."""

CACHE_CAPACITY = 4096

JOIN_CHECK_AFTER_SECONDS = 0.05
"""How long a wait on a collective lasts before the store is asked whether a rank has joined."""
"""Signature pairs remembered per process set (Horovod's response cache holds 1024)."""


class DuplicateNameError(CommValueError):
    """A named collective was started while one of the same kind and name is still in flight
    on this rank (a ``ValueError``, as Horovod's duplicate-name error)."""


@dataclass(frozen=True, slots=True)
class Signature:
    """What every rank must agree on for one collective. ``fields`` are JSON-serialisable."""

    kind: str
    name: str | None
    fields: tuple[tuple[str, Any], ...] = ()
    _encoded: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", tuple((k, _freeze(v)) for k, v in self.fields))

    def encode(self) -> str:
        """The signature as JSON (what ranks compare), computed once: a bucket's signature lists
        every parameter, and each completed collective records it."""
        if self._encoded is None:
            text = json.dumps([self.kind, self.name, [[k, v] for k, v in self.fields]])
            object.__setattr__(self, "_encoded", text)
            return text
        return self._encoded

    def label(self) -> str:
        return f"{self.kind} {self.name!r}" if self.name else f"{self.kind} (unnamed)"


def _freeze(value: Any) -> Any:
    """Lists become tuples so signatures hash (JSON still encodes them as lists)."""
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _decode(text: str) -> dict[str, Any]:
    kind, name, fields = json.loads(text)
    return {"kind": kind, "name": name, **{k: v for k, v in fields}}


def describe_mismatch(own: Signature, seq: int, set_ranks: Sequence[int], entries: dict[int, str]) -> str:
    """Message naming the tensor and listing each rank's value of every differing field."""
    decoded = {q: _decode(t) for q, t in sorted(entries.items())}
    keys: list[str] = []
    for d in decoded.values():
        keys.extend(k for k in d if k not in keys)
    lines = []
    for k in keys:
        values = {q: d.get(k, "<absent>") for q, d in decoded.items()}
        if len({json.dumps(v) for v in values.values()}) > 1:
            per_rank = ", ".join(f"rank {q} = {_short(v)}" for q, v in values.items())
            lines.append(f"  {k}: {per_rank}")
    names = sorted({str(d.get("name") or "(unnamed)") for d in decoded.values()})
    return (
        f"ranks disagree on collective #{seq} ({own.label()}; tensor name(s) {names}) on "
        f"process set {list(set_ranks)}:\n" + "\n".join(lines) + _skip_note(decoded)
        + "\nHINT: every rank must call the "
        "same collectives in the same order with the same op, name, shape, dtype and root; "
        "a parameter that requires grad on one rank only changes the bucket layout."
    )


def _skip_note(decoded: dict[int, dict[str, Any]]) -> str:
    """A line naming the ranks that raised locally and skipped the collective, if any."""
    parts = []
    for q, d in decoded.items():
        if d.get("kind") == "skipped":
            parts.append(f"rank {q} skipped {d.get('skipped_call')} {d.get('name')!r} (it raised "
                         f"{d.get('raised_locally')} there; that rank's own error says why)")
        elif d.get("kind") == "out_of_step":
            parts.append(f"rank {q} is out of step in the transport since collective "
                         f"#{d.get('since')} (its first error says why)")
    return "".join(f"\n  {p}" for p in parts)


def _short(value: Any, limit: int = 300) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(slots=True)
class Op:
    """One collective in flight on this rank."""

    seq: int
    sig: Signature
    nbytes: int
    transports: list[Transport] | None
    t_call_us: float
    t_start: float
    t_launch_us: float = 0.0
    work: Any = None
    published: bool = False
    warned: bool = False
    done: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class Coordinator:
    """Per-process-set state: sequence numbers, signature cache, join board, stall inspection."""

    def __init__(
        self,
        *,
        store: Any,
        prefix: str,
        rank: int,
        ranks: Sequence[int],
        config: CommConfig,
        timeline: Timeline | None,
        peer_watch: PeerWatch | None = None,
    ) -> None:
        self.store = store
        self.peer_watch = peer_watch
        """The heartbeat of a job on several hosts; a wait polls its ``failure``."""
        self.prefix = prefix
        self.rank = rank
        self.ranks = tuple(ranks)
        self.config = config
        self.timeline = timeline
        self.seq = 0
        self._prev: Signature | None = None
        self._cache: set[tuple[Signature | None, Signature]] = set()
        self.outstanding: dict[int, Op] = {}
        self._in_flight: dict[str, int] = {}
        """``"<kind>.<name>"`` of each named collective in flight on this rank -> its ``seq``
        (-1: claimed by name, :meth:`claim_name`, and not numbered yet)."""
        self._checked_seqs: list[int] = []
        self.board = JoinBoard(store, prefix, rank, ranks)
        self.multi = len(self.ranks) > 1 and store is not None
        self.check_seconds_total = 0.0
        self.checks_run = 0
        self.last_done: tuple[int, str] | None = None
        """``(seq, encoded signature)`` of the highest-numbered collective that completed on this
        rank (recorded at shutdown, so a peer still in it does not count this rank as failed)."""
        self.broken: tuple[int, str] | None = None
        """``(seq, label)`` of a collective that was already in the transport on this rank when
        a mismatch was found: the transport's pairing is out of step from there on."""

    # -- begin / launch / wait ------------------------------------------------------------
    def begin(self, sig: Signature, nbytes: int, transports: list[Transport] | None = None) -> Op:
        """Assign the next ``seq`` to a collective and check it (if new) before it is launched.

        A named collective stays *in flight* on this rank from this call until it is waited for
        (:meth:`wait`, i.e. ``synchronize``/the blocking form) or settled; starting a second one
        of the same kind and name meanwhile raises before anything is communicated or numbered,
        so every rank that makes the same calls raises at the same point (Horovod's duplicate
        name error).

        Raises:
            DuplicateNameError: ``sig`` names a collective still in flight on this rank.
            CollectiveMismatchError: ranks disagree; JoinedRankError: a non-reducing collective
            while a rank is joined.
        """
        if self.broken is not None and self.multi:
            self._refuse_out_of_step(sig)
        flight = _flight_key(sig)
        if flight is not None:
            self._refuse_duplicate(sig, flight)
        now_us = self.timeline.now_us() if self.timeline else 0.0
        op = Op(self.seq, sig, nbytes, transports, now_us, time.monotonic())
        if self.timeline:  # start_timeline() may swap timelines while ops are in flight
            op.extra["timeline"] = self.timeline
        self.seq += 1
        if self.multi:
            self.outstanding[op.seq] = op
            try:
                self._check_new(op)
            except BaseException:
                self.outstanding.pop(op.seq, None)  # it never runs: nothing to wait for
                raise
        if flight is not None:
            self._in_flight[flight] = op.seq
            op.extra["flight"] = flight
        return op

    def claim_name(self, sig: Signature) -> str:
        """Mark the named collective ``sig`` in flight on this rank before it has a ``seq`` (a
        collective matched by name, :mod:`~hvd_trainer.comm.ops.by_name`) and return its flight
        key for :meth:`release_name`.

        Raises:
            DuplicateNameError: one of the same kind and name is still in flight on this rank.
            CommValueError: ``sig`` has no name.
        """
        flight = _flight_key(sig)
        if flight is None:
            raise CommValueError(f"{sig.label()}: only a named collective can be claimed by name.")
        self._refuse_duplicate(sig, flight)
        self._in_flight[flight] = -1
        return flight

    def release_name(self, flight: str) -> None:
        """Free a name taken by :meth:`claim_name` (the collective was waited for)."""
        if self._in_flight.get(flight) == -1:
            del self._in_flight[flight]

    def _refuse_duplicate(self, sig: Signature, flight: str) -> None:
        if flight not in self._in_flight:
            return
        seq = self._in_flight[flight]
        which = "matched by name, not run yet" if seq == -1 else f"collective #{seq}"
        raise DuplicateNameError(
            f"{sig.label()}: a collective named {sig.name!r} ({flight}, {which}) is still in flight "
            f"on rank {self.rank}. HINT: synchronize() the first handle before starting another "
            "with the same name, or give each concurrent collective its own name."
        )

    @contextlib.contextmanager
    def local_checks(self, kind: str, name: str | None) -> Iterator[None]:
        """Keep the ranks in step when this rank rejects a collective's arguments locally.

        Wrap the argument checks of a collective that end in :meth:`begin`. If the body raises
        before :meth:`begin` numbered the collective, this rank still consumes its sequence
        number with a ``"skipped"`` signature, compared across ranks like any other: when every
        rank raised at the same call they all skipped it and carry on in step (the local error
        propagates); when another rank started the collective, both ranks see the mismatch and
        raise :class:`CollectiveMismatchError` naming the rank that skipped, instead of pairing
        this rank's next collective with the other rank's pending one.

        Raises:
            CollectiveMismatchError: another rank of the set did not skip this collective.
        """
        start = self.seq
        try:
            yield
        except Exception as exc:
            if self.seq == start and self.multi and self.config.check_signatures:
                self._skip(kind, name, exc)
            raise

    def _skip(self, kind: str, name: str | None, exc: BaseException) -> None:
        """Consume the next ``seq`` with a ``"skipped"`` signature and compare it across ranks."""
        sig = Signature("skipped", name, (("skipped_call", kind), ("raised_locally", type(exc).__name__)))
        op = Op(self.seq, sig, 0, None, 0.0, time.monotonic())
        self.seq += 1
        self._prev = sig
        self.outstanding[op.seq] = op
        try:
            with self._store_lost(op):
                self._exchange(op)
        except CollectiveMismatchError as mismatch:
            raise CollectiveMismatchError(f"{mismatch}\n  rank {self.rank}'s own error: {exc}") from exc
        finally:
            self.outstanding.pop(op.seq, None)

    def _refuse_out_of_step(self, sig: Signature) -> None:
        """Consume the next ``seq`` with an ``"out_of_step"`` entry (so a peer checking this
        collective raises instead of launching it) and raise: once a collective was left
        half-finished in the transport, any later one would be paired with the wrong one."""
        seq, self.seq = self.seq, self.seq + 1
        since, label = self.broken or (0, "")
        entry = Signature("out_of_step", sig.name, (("collective", sig.kind), ("since", since)))
        with contextlib.suppress(RuntimeError):  # the store may be gone with a failed peer
            self.store.set(self._key(seq, self.rank), entry.encode())
            self.store.set(f"{self.prefix}/m/{seq}/{self.rank}", "1")
            self._checked_seqs.append(seq)
        raise CollectiveMismatchError(
            f"{sig.label()} (collective #{seq}) cannot run: process set {list(self.ranks)} is out "
            f"of step, collective #{since} ({label}) was left half-finished in the transport on rank "
            f"{self.rank} by an earlier mismatch, so every later collective would be paired with "
            "the wrong one. HINT: the job cannot continue; fix the first error reported (on "
            "every rank) and restart."
        )

    def _check_new(self, op: Op) -> None:
        """Announce ``op`` to joined ranks and compare its signature across ranks if new."""
        sig = op.sig
        if self.board.active:
            self._announce(op)
        key = (self._prev, sig)
        self._prev = sig
        if self.config.check_signatures and key not in self._cache:
            with self._store_lost(op):
                self._exchange(op)
            if len(self._cache) >= CACHE_CAPACITY:
                self._cache.clear()
            self._cache.add(key)

    def launched(self, op: Op, work: Any) -> None:
        """Record that ``op``'s transport call was issued and returned ``work``."""
        op.work = work
        if self.timeline:
            op.t_launch_us = self.timeline.now_us()

    def wait(self, op: Op) -> None:
        """Block until ``op`` completes, inspecting for joins, mismatches and stalls meanwhile."""
        if op.done:
            return
        t_wait_us = self.timeline.now_us() if self.timeline else 0.0
        work = op.work
        try:
            if work is not None:
                if self.multi and _is_cpu_work(op):
                    self._guarded_wait(op, work)
                else:
                    work.wait()
        finally:
            self._land(op)  # a failed collective frees its name too
        op.done = True
        if self.last_done is None or op.seq > self.last_done[0]:
            self.last_done = (op.seq, op.sig.encode())
        self.outstanding.pop(op.seq, None)
        if op.extra.get("unpublish"):
            self._unpublish(op.seq)
        if self._checked_seqs and op.sig.kind in _RECEIVE_FROM_ALL:
            self._drop_checked_before(op.seq)
        if self.timeline and op.extra.get("timeline") is self.timeline:
            self._record(op, t_wait_us)

    def settle(self, op: Op) -> None:
        """Mark an op without a transport call (a pure agreement) as done. Its store entry is
        kept: a slower rank may still have to read it."""
        self._land(op)
        op.done = True
        self.outstanding.pop(op.seq, None)

    def _land(self, op: Op) -> None:
        """``op`` is no longer in flight: its name may be used again."""
        flight = op.extra.pop("flight", None)
        if flight is not None and self._in_flight.get(flight) == op.seq:
            del self._in_flight[flight]

    def wait_work(self, op: Op, work: Any) -> None:
        """Wait for an intermediate transport call of ``op`` (same inspection as :meth:`wait`)."""
        if self.multi and _is_cpu_work(op):
            self._guarded_wait(op, work)
        else:
            work.wait()

    def forget_history(self) -> None:
        """Reset the order key (after join, where ranks' histories legitimately differ)."""
        self._prev = None

    # -- internals ------------------------------------------------------------------------
    def _key(self, seq: int, rank: int) -> str:
        return f"{self.prefix}/s/{seq}/{rank}"

    def _guarded_wait(self, op: Op, work: Any) -> None:
        slice_s = 0.002
        wait_start = time.monotonic()
        while True:
            try:
                work.wait(timedelta(seconds=slice_s))
                return
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower():
                    self._diagnose_failure(op, exc)
                    raise
            self._raise_if_unreachable(op)
            now = time.monotonic()
            with self._store_lost(op):
                self._on_slow(op, now - op.t_start, now - wait_start)
            slice_s = min(slice_s * 2, 0.25)

    def _on_slow(self, op: Op, elapsed: float, waited: float) -> None:
        # A joined rank is only looked for once this wait has lasted JOIN_CHECK_AFTER_SECONDS:
        # an ordinary allreduce on a slow link often takes a few milliseconds, and a store
        # round trip per bucket and step would cost more than it (measured: bench/step_overhead.py).
        if not self.board.active and waited >= JOIN_CHECK_AFTER_SECONDS and self.board.started():
            self._activate_join()
        if not self.config.check_signatures:
            return
        if not op.published and elapsed >= self.config.suspect_after_seconds:
            self.store.set(self._key(op.seq, self.rank), op.sig.encode())
            op.published = op.extra["unpublish"] = True
        if op.published:
            entries = self._read_entries(op.seq)
            self._compare(op, entries)
            self._inspect_stall(op, entries, elapsed)

    def _activate_join(self) -> None:
        self.board.active = True
        for pending in sorted(self.outstanding.values(), key=lambda o: o.seq):
            self._announce(pending)

    def _announce(self, op: Op) -> None:
        if op.sig.kind in REDUCING_KINDS:
            self.board.announce(op.seq, op.transports)
            return
        message = (
            f"{op.sig.label()} (collective #{op.seq}) cannot run while a rank has called join(): "
            "joined ranks only take part in allreduce. HINT: call allgather/broadcast/alltoall/"
            "reducescatter/barrier before join(), or after every rank has joined."
        )
        self.board.announce(op.seq, None, error=message)
        raise JoinedRankError(message)

    def _exchange(self, op: Op) -> None:
        """Publish this rank's signature for ``op.seq`` and compare with every other rank's."""
        t0 = time.perf_counter()
        t0_us = self.timeline.now_us() if self.timeline else 0.0
        self.store.set(self._key(op.seq, self.rank), op.sig.encode())
        op.published = True
        self._checked_seqs.append(op.seq)
        others = [q for q in self.ranks if q != self.rank]
        keys = [self._key(op.seq, q) for q in others]
        arrived = not self.board.active and self._poll_keys(keys, self.config.suspect_after_seconds)
        entries = self._read_entries(op.seq) if arrived else {}
        if len(entries) < len(self.ranks):  # late, joined, blocked elsewhere: inspect slowly
            entries = self._slow_exchange(op)
        self._compare(op, entries)
        self.checks_run += 1
        self.check_seconds_total += time.perf_counter() - t0
        if self.timeline:
            self.timeline.event(op.sig.name or op.sig.kind, "check", t0_us, self.timeline.now_us(),
                                row=op_name(op.sig), activity=activity_name("check", op.sig.kind),
                                seq=op.seq)

    def _poll_keys(self, keys: list[str], budget_seconds: float) -> bool:
        """Whether all ``keys`` exist within ``budget_seconds`` (polling: a timed-out
        ``store.wait`` leaves a late reply on the client socket, so it is never used)."""
        deadline = time.monotonic() + budget_seconds
        pause = 5e-5
        while not self.store.check(keys):
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return True

    def _slow_exchange(self, op: Op) -> dict[int, str]:
        pause = 0.01
        while True:
            if not self.board.active and self.board.started():
                self.board.active = True
            excused = self.board.joined_ranks() if self.board.active else set()
            entries = self._read_entries(op.seq)
            self._compare(op, entries)
            if all(q in entries or q in excused for q in self.ranks):
                if self.board.active:
                    self._announce(op)
                return entries
            self._inspect_stall(op, entries, time.monotonic() - op.t_start, excused)
            self._raise_if_unreachable(op)
            time.sleep(pause)
            pause = min(pause * 2, 0.25)

    def _read_entries(self, seq: int) -> dict[int, str]:
        entries = {}
        for q in self.ranks:
            value = try_get(self.store, self._key(seq, q))
            if value is not None:
                entries[q] = value
        return entries

    def _compare(self, op: Op, entries: dict[int, str]) -> None:
        if len(set(entries.values())) <= 1:
            return
        message = describe_mismatch(op.sig, op.seq, self.ranks, entries)
        self._cache.clear()  # histories diverged: check every collective again
        if op.work is not None and not op.done:
            self.broken = (op.seq, op.sig.label())
        self._await_peers_seen(op.seq)
        raise CollectiveMismatchError(message)

    def _await_peers_seen(self, seq: int) -> None:
        """Before raising, wait (bounded) until every rank has seen the mismatch too, so no
        rank is left blocked on a peer that already exited."""
        self.store.set(f"{self.prefix}/m/{seq}/{self.rank}", "1")
        keys = [f"{self.prefix}/m/{seq}/{q}" for q in self.ranks]
        budget = 2 * self.config.suspect_after_seconds + 2.0
        if not self._poll_keys(keys, budget):
            log.warning("not every rank acknowledged collective #%d's mismatch within %.1fs", seq, budget)

    def _inspect_stall(
        self, op: Op, entries: dict[int, str], elapsed: float, excused: set[int] | None = None
    ) -> None:
        cfg = self.config
        self._raise_if_peer_raising(op)
        missing = [q for q in self.ranks if q not in entries and q not in (excused or set())]
        if not missing:
            return
        if elapsed >= cfg.suspect_after_seconds:
            self._raise_if_gone(op, missing)
        text = (
            f"rank(s) {missing} have not reached {op.sig.label()} (collective #{op.seq} on process "
            f"set {list(self.ranks)}) after {elapsed:.1f}s; rank {self.rank} is waiting for them."
        )
        if cfg.stall_shutdown_seconds and elapsed >= cfg.stall_shutdown_seconds:
            exit_hard_at_exit()  # the transport is wedged: never hang at exit
            raise StallError(text + " HINT: a rank is stuck, crashed, or skipped this collective.")
        if cfg.stall_warning_seconds and elapsed >= cfg.stall_warning_seconds and not op.warned:
            op.warned = True
            warnings.warn(text, RuntimeWarning, stacklevel=3)

    @contextlib.contextmanager
    def _store_lost(self, op: Op) -> Iterator[None]:
        """Turn a lost connection to the job's key-value store into a RankFailedError."""
        try:
            yield
        except dist.DistNetworkError as exc:
            exit_hard_at_exit(PEER_FAILED_EXIT_CODE)  # the job is broken; never hang in teardown
            raise RankFailedError(
                f"{op.sig.label()} (collective #{op.seq}) failed: rank {self.rank} lost the job's "
                f"key-value store ({exc.__class__.__name__}). The process hosting it has died: "
                "global rank 0 when the job was started by Lightning's devices=N or plain "
                "MASTER_ADDR/MASTER_PORT variables, else the launcher (torchrun/hvdrun agent). "
                "HINT: look at that process's output for the original error."
            ) from exc

    def _raise_if_unreachable(self, op: Op) -> None:
        """Raise HostUnreachableError once the heartbeat found a partition (one attribute read)."""
        watch = self.peer_watch
        if watch is None or watch.failure is None:
            return
        watch.raised = True
        watch.await_local_peers()  # so each rank on this host raises its own error
        exit_hard_at_exit(PEER_FAILED_EXIT_CODE)  # the collective stays in flight: never hang at exit
        raise HostUnreachableError(
            f"{op.sig.label()} (collective #{op.seq}) cannot complete: {watch.failure.message}"
        )

    def _raise_if_gone(self, op: Op, missing: list[int]) -> None:
        """Raise RankFailedError when a missing rank has exited (probed at most every 0.5 s)."""
        now = time.monotonic()
        if now < op.extra.get("next_probe", 0.0):
            return
        op.extra["next_probe"] = now + 0.5
        try:
            # a peer that shut down right after completing its part of this very collective (its
            # data may still be on a slow link) is not failed: the transport decides
            gone = [p for p in find_gone(self.store, missing)
                    if not finished(self.store, p.rank, self.prefix, op.seq, op.sig.encode())]
            relayed = stopped_for_peers(self.store, gone)
        except Exception:  # noqa: BLE001 - the store may be gone with the failed peer
            return
        if gone:
            wait_until_ended(gone)  # so the launcher sees the gone rank's own exit first
            await_local_raising(self.store, self.ranks, self.rank)  # each rank here prints its error
            exit_hard_at_exit(PEER_FAILED_EXIT_CODE)  # a transport call may be in flight
            what = f"{op.sig.label()} (collective #{op.seq})"
            if len(relayed) == len(gone):  # they did not skip it: they lost a peer first
                raise RankFailedError(describe_failure(what, gone, [], relayed))
            raise RankFailedError(describe_gone(what, gone))

    def _raise_if_peer_raising(self, op: Op) -> None:
        """Raise RankFailedError when a rank of this collective is raising a peer failure itself
        (probed at most every 0.5 s): it lost a peer this rank may not be talking to (in a ring,
        a rank waits on its neighbour only), and it is leaving, so this collective cannot complete."""
        now = time.monotonic()
        if now < op.extra.get("next_raising_probe", 0.0):
            return
        op.extra["next_raising_probe"] = now + 0.5
        try:
            raising = find_raising(self.store, self.ranks, self.rank)
            if not raising:
                return
            _dead, others = find_dead_peers(self.store, self.ranks, self.rank, grace_seconds=0.0)
        except Exception:  # noqa: BLE001 - the store may be gone with the failed peer
            return
        remote = [p for p in others if p not in raising]
        message = describe_failure(f"{op.sig.label()} (collective #{op.seq})", raising, remote, raising)
        await_local_raising(self.store, self.ranks, self.rank)  # each rank here prints its error
        exit_hard_at_exit(PEER_FAILED_EXIT_CODE)  # the collective stays in flight: never hang at exit
        raise RankFailedError(message)

    def _unpublish(self, seq: int) -> None:
        with contextlib.suppress(RuntimeError):
            self.store.delete_key(self._key(seq, self.rank))

    def _drop_checked_before(self, seq: int) -> None:
        """Delete this rank's pre-check entries older than ``seq``. Safe once a collective
        that receives from every member completed at ``seq``: every member has entered it, so
        none can still be reading an older entry. (A broadcast root may finish first, so a
        broadcast does not count.) Keeps the store bounded."""
        keep = [k for k in self._checked_seqs if k >= seq]
        for k in self._checked_seqs:
            if k < seq:
                self._unpublish(k)
        self._checked_seqs = keep

    def _diagnose_failure(self, op: Op, exc: BaseException) -> None:
        """The transport failed (e.g. a peer exited): raise a mismatch instead if one is known,
        else name the dead peer; when the store is gone too, its host died (RankFailedError)."""
        try:
            entries = self._read_entries(op.seq)
            entries.setdefault(self.rank, op.sig.encode())
        except dist.DistNetworkError:  # the store went with the failed peer: say so
            with self._store_lost(op):
                raise
        except Exception:  # noqa: BLE001 - the store may be gone with the failed peer
            return
        if len(set(entries.values())) > 1:
            raise CollectiveMismatchError(
                describe_mismatch(op.sig, op.seq, self.ranks, entries)
            ) from exc
        self._name_dead_peer(op, exc)

    def _name_dead_peer(self, op: Op, exc: BaseException) -> None:
        """The transport failed and no mismatch is known: name the rank that died, if any."""
        try:
            dead, remote = find_dead_peers(self.store, self.ranks, self.rank)
            relayed = stopped_for_peers(self.store, dead)
        except Exception:  # noqa: BLE001 - the store may be gone with the failed peer
            return
        message = describe_failure(f"{op.sig.label()} (collective #{op.seq})", dead, remote, relayed)
        if message is not None:
            wait_until_ended(dead)  # so the launcher sees the dead rank's own exit first
            await_local_raising(self.store, self.ranks, self.rank)  # each rank here prints its error
            exit_hard_at_exit(PEER_FAILED_EXIT_CODE)
            raise RankFailedError(message) from exc

    def _record(self, op: Op, t_wait_us: float) -> None:
        tl = self.timeline
        assert tl is not None
        end = tl.now_us()
        name, kind, row = op.sig.name or op.sig.kind, op.sig.kind, op_name(op.sig)
        launch = op.t_launch_us or op.t_call_us
        phases = (
            ("queue", op.t_call_us, launch, {"bytes": op.nbytes}),
            (kind, launch, end, {"bytes": op.nbytes}),
            ("wait", t_wait_us, end, {}),
        )
        for phase, start, stop, extra in phases:
            tl.event(name, phase, start, stop, row=row, activity=activity_name(phase, kind),
                     seq=op.seq, **extra)


def op_name(sig: Signature) -> str:
    """Horovod's name of the operation: ``"<kind>.<tensor name>"``, ``"<kind>.noname"``."""
    return f"{sig.kind}.{sig.name or 'noname'}"


def _flight_key(sig: Signature) -> str | None:
    """Horovod's operation name, ``"<kind>.<name>"`` (e.g. ``"allreduce.loss"``), for a named
    user collective; ``None`` for unnamed ones and the gradient reducer's buckets (whose
    names repeat every step by design)."""
    if not sig.name or sig.kind == "bucket":
        return None
    return op_name(sig)


def _is_cpu_work(op: Op) -> bool:
    return op.extra.get("device", "cpu") == "cpu"

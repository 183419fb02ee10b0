"""Who trains now: the membership rounds of in-process recovery, over the job's store.

In-process recovery (``hvdrun --recovery in-process``) keeps the surviving processes when a rank
dies: they drop their process group, agree here on the new membership and build a new group
(:func:`hvd_trainer.comm.session.recover`). A restarted worker joins the same way. Each worker
has a fixed *slot* (the rank torchrun gave it at launch, ``0 .. max_np-1``); ranks of a
membership are the members' slots in order, so rank 0 is the lowest surviving slot.

Keys (torchrun's agent store, which outlives every worker; all under ``hvd/quorum/<run id>/``):

* ``epoch``: the number ``E`` of the newest closed membership (absent before the first);
* ``<E>/arrive/<slot>``: ``<host>|<pid>`` of a worker that wants to be in membership ``E``;
  ``<E>/arrived``: how many did (a counter: a joiner's arrival is how the members learn of it);
* ``<E>/members``: the closed membership, ``slot|host|pid`` entries joined by ``,``, written
  once (``compare_set`` from absent: the first closer wins, every other reader adopts it);
* ``<E>/reform_at``: the check count (:meth:`Quorum.reform_due`) at which the members of ``E``
  leave it together to admit a joiner;
* ``gone/<slot>/<pid>``: the host name of a worker process that ended, written by hvdrun's agent
  on that host when hvdrun's worker entry started the slot again (:func:`gone_key`).

When a round closes (any arrived member may close it; a joiner only by rules 1-2; the first round,
where everyone is a first-timer, only when every launched worker arrived):

1. every member of the previous round has arrived; or
2. at least ``min_np`` have arrived and every missing one is known dead (a process on this host
   whose pid is gone, a process on another host whose agent wrote it ``gone``, or a rank the
   heartbeat found unreachable); or
3. at least ``min_np`` have arrived and ``settle_seconds`` passed since this worker arrived (a
   missing rank on another host that nobody reported gone: a killed host, whose agent died too).

A worker that arrives after its round closed without it is not lost: it stays arrived for the
next round, which the members open at their next step boundary (``reform_due``).

The protocol never needs a process group, so it works while the old one is broken.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hvd_trainer.comm.base.errors import RankFailedError
from hvd_trainer.comm.base.fatal import pid_alive
from hvd_trainer.comm.base.store import try_get

__all__ = ["Member", "Membership", "Quorum", "JobFinished", "SETTLE_ENV", "DEFAULT_SETTLE_SECONDS",
           "gone_key"]

SETTLE_ENV = "HVD_ELASTIC_SETTLE_SECONDS"
"""Seconds a round waits for a missing member on another host before closing without it."""

DEFAULT_SETTLE_SECONDS = 2.0

_POLL_SECONDS = 0.005


def gone_key(run_id: str, slot: int, pid: int) -> str:
    """The store key saying that process ``pid`` of launch slot ``slot`` in job ``run_id`` has
    ended (its value: the host's name). A round does not wait for a missing member whose key is
    set (rule 2 of the module docstring)."""
    return f"{_job_prefix(run_id)}/gone/{slot}/{pid}"


def _job_prefix(run_id: str) -> str:
    return f"hvd/quorum/{run_id}"


class JobFinished(Exception):  # noqa: N818 - a state, not an error
    """The members finished the job while this worker waited to join: nothing is left to do."""


@dataclass(frozen=True, slots=True)
class Member:
    """One worker of a membership: its launch slot, host name and process id."""

    slot: int
    host: str
    pid: int

    def encode(self) -> str:
        return f"{self.slot}|{self.host}|{self.pid}"

    @staticmethod
    def decode(text: str) -> Member:
        slot, host, pid = text.split("|")
        return Member(int(slot), host, int(pid))


@dataclass(frozen=True, slots=True)
class Membership:
    """A closed round: its number and members in rank order (lowest slot first)."""

    epoch: int
    members: tuple[Member, ...]

    def rank_of(self, slot: int) -> int:
        """This slot's rank in the membership.

        Raises:
            ValueError: ``slot`` is not a member.
        """
        for rank, member in enumerate(self.members):
            if member.slot == slot:
                return rank
        raise ValueError(f"slot {slot} is not in membership {self.epoch}")

    @property
    def size(self) -> int:
        return len(self.members)

    def hosts(self) -> list[str]:
        """Distinct hosts in the order of their first member."""
        return list(dict.fromkeys(m.host for m in self.members))


class Quorum:
    """One worker's side of the membership rounds (see the module docstring).

    Args:
        store: the job's raw store (torchrun's agent store: it must outlive the workers).
        run_id: names this job's keys (torchrun's ``TORCHELASTIC_RUN_ID``).
        slot: this worker's launch rank. max_slots: slots that may exist (``--max-np``).
        min_np: the fewest members a round may close with.
        settle_seconds: see rule 3 of the module docstring.
        timeout_seconds: how long a round may wait for ``min_np`` members, seconds.
        host, pid: this worker's host name and process id (default: this process's).
        launched: how many workers the launch started (slots ``0 .. launched-1``): the first
            round waits for all of them (default: ``max_slots``).

    Raises:
        ValueError: ``slot`` is outside ``[0, max_slots)``.
    """

    def __init__(self, store: Any, run_id: str, *, slot: int, max_slots: int, min_np: int,
                 settle_seconds: float = DEFAULT_SETTLE_SECONDS, timeout_seconds: float = 600.0,
                 host: str | None = None, pid: int | None = None, launched: int | None = None) -> None:
        if not 0 <= slot < max_slots:
            raise ValueError(f"slot {slot} outside [0, {max_slots}): --max-np must cover every launched rank")
        self.store, self.slot, self.max_slots = store, slot, max_slots
        self.launched = max_slots if launched is None else launched
        self.min_np, self.settle_seconds, self.timeout_seconds = min_np, settle_seconds, timeout_seconds
        self._prefix, self._run_id = _job_prefix(run_id), run_id
        self.me = Member(slot, host or socket.gethostname(), os.getpid() if pid is None else pid)
        self.current: Membership | None = None
        self._before: Membership | None = None
        """The membership this worker left at its last :meth:`reform` (``None`` before one)."""
        self._checks = 0
        self._reform_at: int | None = None
        self._lost: set[int] = set()

    def _key(self, *parts: object) -> str:
        return "/".join([self._prefix, *map(str, parts)])

    # -- rounds ---------------------------------------------------------------------------------
    def latest_epoch(self) -> int:
        """The newest closed round's number (0: none yet)."""
        value = try_get(self.store, self._key("epoch"))
        return 0 if value is None else int(value)

    def join(self) -> Membership:
        """Enter the job: the first round at launch, else as a joiner admitted at the members'
        next step boundary (a joiner closes a round itself only when every member of the last
        one has arrived again or is known dead: every worker was restarted). Returns the
        membership this worker is in.

        Raises:
            RankFailedError: no round took this worker within ``timeout_seconds``.
        """
        latest = self.latest_epoch()
        previous = None if latest == 0 else self._read_members(latest)
        return self._enter(latest + 1, previous, may_close=latest == 0, joiner=latest > 0)

    def reform(self, lost_ranks: Sequence[int] = ()) -> Membership:
        """Leave the current membership (after a peer failed, or to admit a joiner) for the next.

        Args:
            lost_ranks: ranks of the current membership known to be gone (the heartbeat found
                their host unreachable): the round does not wait for them.

        Raises:
            RankFailedError: fewer than ``min_np`` workers arrived within ``timeout_seconds``.
        """
        if self.current is None:
            raise RuntimeError("reform() before join()")
        self._lost = {self.current.members[r].slot for r in lost_ranks if 0 <= r < self.current.size}
        self._before = self.current
        return self._enter(self.current.epoch + 1, self.current, may_close=True)

    def first_survivor(self) -> bool:
        """After :meth:`reform`: whether this worker has the lowest rank among the members that
        were also in the membership it left (the one that reports the re-form: rank 0 may be a
        worker that just joined). ``False`` before any reform."""
        if self._before is None or self.current is None:
            return False
        before = {m.slot for m in self._before.members}
        survivors = [m.slot for m in self.current.members if m.slot in before]
        return bool(survivors) and survivors[0] == self.slot

    def _enter(self, epoch: int, previous: Membership | None, *, may_close: bool,
               joiner: bool = False) -> Membership:
        deadline = time.monotonic() + self.timeout_seconds
        while True:
            members = self._round(epoch, previous, may_close or joiner, joiner, deadline)
            if any(m.slot == self.slot for m in members.members):
                self.current, self._checks, self._reform_at = members, 0, None
                return members
            previous, joiner, epoch = members, True, epoch + 1  # closed without us: next round

    def _round(self, epoch: int, previous: Membership | None, may_close: bool, joiner: bool,
               deadline: float) -> Membership:
        self.store.set(self._key(epoch, "arrive", self.slot), f"{self.me.host}|{self.me.pid}")
        self.store.add(self._key(epoch, "arrived"), 1)
        arrived_at = time.monotonic()
        expected: dict[int, Member | None] = (
            {m.slot: m for m in previous.members} if previous else dict.fromkeys(range(self.launched))
        )
        while True:
            closed = try_get(self.store, self._key(epoch, "members"))
            if closed is not None:
                return self._adopt(epoch, closed)
            if try_get(self.store, self._key("finished")) is not None:
                raise JobFinished(f"the job finished while slot {self.slot} waited to join")
            if may_close:
                here = self._arrivals(epoch)
                # rule 3 is for members leaving a membership; the first round waits for every launch
                waited = 0.0 if joiner or previous is None else time.monotonic() - arrived_at
                if self._should_close(here, expected, waited):
                    text = ",".join(m.encode() for m in sorted(here.values(), key=lambda m: m.slot))
                    self.store.compare_set(self._key(epoch, "members"), "", text)
                    continue  # read back whichever list won
            if time.monotonic() > deadline:
                raise RankFailedError(
                    f"elastic: membership {epoch} did not form within {self.timeout_seconds:g} s "
                    f"(need at least {self.min_np} workers). HINT: check that the lost workers are "
                    "restarted (hvdrun --max-restarts) or lower --min-np."
                )
            time.sleep(_POLL_SECONDS)

    def _adopt(self, epoch: int, text: str) -> Membership:
        members = Membership(epoch, tuple(Member.decode(t) for t in text.split(",") if t))
        # a store counter only grows: max() keeps a late reader from moving the epoch back
        if self.latest_epoch() < epoch:
            self.store.set(self._key("epoch"), str(epoch))
        return members

    def _arrivals(self, epoch: int) -> dict[int, Member]:
        found = {}
        for slot in range(self.max_slots):
            value = try_get(self.store, self._key(epoch, "arrive", slot))
            if value is not None:
                host, _, pid = value.partition("|")
                found[slot] = Member(slot, host, int(pid))
        return found

    def _should_close(self, here: dict[int, Member], expected: dict[int, Member | None],
                      waited: float) -> bool:
        missing = [s for s in expected if s not in here]
        if not missing:
            return True
        if len(here) < self.min_np:
            return False
        if all(self._known_dead(expected[s]) for s in missing):
            return True
        return waited >= self.settle_seconds

    def _known_dead(self, member: Member | None) -> bool:
        if member is None:
            return False
        if member.slot in self._lost:  # asked only while it has not arrived
            return True
        if member.host == self.me.host:
            return not pid_alive(member.pid)
        return bool(self.store.check([gone_key(self._run_id, member.slot, member.pid)]))

    def _read_members(self, epoch: int) -> Membership:
        text = try_get(self.store, self._key(epoch, "members"))
        return Membership(epoch, tuple(Member.decode(t) for t in (text or "").split(",") if t))

    def finish(self) -> None:
        """Say that the training function returned on the members: a worker still waiting to
        join then ends quietly (:class:`JobFinished`) instead of waiting for a round forever."""
        self.store.set(self._key("finished"), "1")

    # -- step boundaries ------------------------------------------------------------------------
    def reform_due(self) -> bool:
        """Called by every member at each step boundary (``State.commit``): whether the members
        leave now, together, to admit a joiner.

        Rank 0 looks for arrivals at the next round and, finding one at check ``k``, schedules
        the reform for check ``k + 1``; every member reads the schedule at each check. A member
        cannot pass check ``k + 1`` without a collective with rank 0 after rank 0's check ``k``,
        so all of them see it in time and leave at the same check (one or two store round trips
        per call).
        """
        if self.current is None:
            return False
        self._checks += 1
        epoch = self.current.epoch
        if self._reform_at is None:
            leader = self.current.members[0].slot == self.slot
            if leader and self.store.add(self._key(epoch + 1, "arrived"), 0) > 0:
                self._reform_at = self._checks + 1
                self.store.compare_set(self._key(epoch, "reform_at"), "", str(self._reform_at))
            else:
                value = try_get(self.store, self._key(epoch, "reform_at"))
                self._reform_at = None if value is None else int(value)
        return self._reform_at is not None and self._checks >= self._reform_at


def describe(members: Sequence[Member]) -> str:
    """``slot 0 (hostA pid 12), slot 2 (hostB pid 40)``."""
    return ", ".join(f"slot {m.slot} ({m.host} pid {m.pid})" for m in members)

"""Name the rank that died when a collective's transport fails.

At init every rank publishes ``<host>|<pid>`` in the job's key-value store, and at
``shutdown()`` (also run at interpreter exit, after an uncaught error too) it leaves an "exited"
mark there. A rank waiting for peers that never arrive at a collective, or whose gloo transport
failed ("Connection closed by peer" and an address is all gloo says), looks for those marks and
probes the peers on its own host for liveness, so the error can say *which* rank is gone, on any
host that left its mark. A peer on another host that died without one is listed as a candidate.
A rank that left only because it lost a peer itself says so in its mark, so that its neighbours
do not blame it: the error then points past it, at the other hosts. A rank that shuts down
normally also records, before its mark, the last collective it completed on each process set
(:func:`finished`): over a slow link it may finish its part of the last collective and exit
while a peer is still receiving, and that peer must not count it as failed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hvd_trainer.comm.base.errors import RankFailedError
from hvd_trainer.comm.base.fatal import (
    PEER_FAILED_EXIT_CODE,
    exit_hard_at_exit,
    flush_before_hard_exit,
    pid_alive,
    stopped_for_a_peer,
)
from hvd_trainer.comm.base.store import try_get

__all__ = [
    "Peer", "publish", "mark_exited", "finished", "find_dead_peers", "find_gone", "stopped_for_peers",
    "wait_until_ended", "await_local_raising", "find_raising", "describe_failure", "describe_gone",
    "raise_if_peer_failed",
]

_KEY = "hvd/proc/{rank}"
_EXITED = "hvd/exited/{rank}"
_LAST_DONE = "hvd/last_done/{rank}"
_RAISING = "hvd/raising/{rank}"
_RAISING_COUNT = "hvd/raising_count"
_FOR_A_PEER = "|peer"


@dataclass(frozen=True, slots=True)
class Peer:
    rank: int
    host: str
    pid: int


_exit_wait: tuple[Any, list[Peer]] | None = None
"""The store and the local ranks that raised a peer failure with this one (for its hard exit)."""


def publish(store: Any, rank: int) -> None:
    """Record this process's host and pid under its rank, clearing its earlier marks."""
    global _exit_wait
    store.set(_KEY.format(rank=rank), f"{socket.gethostname()}|{os.getpid()}")
    store.delete_key(_EXITED.format(rank=rank))
    store.delete_key(_LAST_DONE.format(rank=rank))
    store.delete_key(_RAISING.format(rank=rank))
    _exit_wait = None  # a new world: the ranks that raised with this one are no concern now


def mark_exited(store: Any, rank: int, for_a_peer: bool | None = None,
                last_done: Mapping[str, tuple[int, str]] | None = None) -> None:
    """Leave the "exited" mark of ``rank`` (at shutdown); never raises (the store may be gone).

    ``for_a_peer``: the rank leaves because another rank failed (default: whether this process
    raised such an error, :func:`~hvd_trainer.comm.base.fatal.stopped_for_a_peer`).
    ``last_done``: per process set (its coordinator's store prefix), the sequence number and
    encoded signature of the last collective this rank completed (written before the mark,
    read by :func:`finished`).
    """
    if for_a_peer is None:
        for_a_peer = stopped_for_a_peer()
    with contextlib.suppress(Exception):  # the process hosting the store may have exited first
        if last_done and not for_a_peer:
            store.set(_LAST_DONE.format(rank=rank), json.dumps({k: list(v) for k, v in last_done.items()}))
        store.set(_EXITED.format(rank=rank), f"{os.getpid()}{_FOR_A_PEER if for_a_peer else ''}")


def finished(store: Any, rank: int, prefix: str, seq: int, signature: str) -> bool:
    """Whether the last collective ``rank`` completed before it shut down, on the set with store
    prefix ``prefix``, was collective ``seq`` with this ``signature`` (``False`` when it left
    no record, e.g. after a failure)."""
    with contextlib.suppress(Exception):
        value = try_get(store, _LAST_DONE.format(rank=rank))
        if value is not None:
            return json.loads(value).get(prefix) == [seq, signature]
    return False


def stopped_for_peers(store: Any, peers: Sequence[Peer]) -> list[Peer]:
    """The ``peers`` whose "exited" mark says they left because another rank failed."""
    found = []
    for p in peers:
        with contextlib.suppress(Exception):
            mark = try_get(store, _EXITED.format(rank=p.rank))
            if mark is not None and mark.endswith(_FOR_A_PEER):
                found.append(p)
    return found


def _exited(store: Any, rank: int) -> bool:
    return try_get(store, _EXITED.format(rank=rank)) is not None


def _lookup(store: Any, rank: int) -> Peer | None:
    value = try_get(store, _KEY.format(rank=rank))
    if value is None:
        return None
    host, _, pid = value.rpartition("|")
    return Peer(rank, host, int(pid))


def find_dead_peers(
    store: Any, ranks: Sequence[int], me: int, *, grace_seconds: float = 1.0
) -> tuple[list[Peer], list[Peer]]:
    """Return ``(dead local peers, peers on other hosts)`` among ``ranks`` other than ``me``.

    A peer whose socket just closed may still be exiting, so local peers are re-probed for up
    to ``grace_seconds`` before being reported alive.
    """
    host = socket.gethostname()
    peers = [p for r in ranks if r != me and (p := _lookup(store, r)) is not None]
    deadline = time.monotonic() + grace_seconds
    while True:
        dead = [p for p in peers if _is_gone(store, p, host)]
        if dead or time.monotonic() >= deadline:
            return dead, [p for p in peers if p.host != host]
        time.sleep(0.05)


def _is_gone(store: Any, peer: Peer, host: str) -> bool:
    """``peer`` left its "exited" mark, or runs on this ``host`` and its process has ended."""
    return _exited(store, peer.rank) or (peer.host == host and not pid_alive(peer.pid))


def _named(peers: Sequence[Peer]) -> str:
    return ", ".join(f"rank {p.rank} (pid {p.pid} on {p.host})" for p in peers)


def find_gone(store: Any, ranks: Sequence[int]) -> list[Peer]:
    """The ranks among ``ranks`` that left an "exited" mark or, on this host, no longer run
    (no grace period: for peers that are late to a collective, probed repeatedly)."""
    host = socket.gethostname()
    gone = []
    for r in ranks:
        peer = _lookup(store, r)
        if peer is not None and _is_gone(store, peer, host):
            gone.append(peer)
    return gone


def wait_until_ended(peers: Sequence[Peer], timeout_seconds: float = 5.0) -> None:
    """Wait (bounded) until the processes of ``peers`` on this host have ended.

    A rank that raised marks itself exited before its interpreter has finished; if the survivors
    stopped first, the launcher would see *them* fail first and name the wrong rank.
    """
    host = socket.gethostname()
    local = [p for p in peers if p.host == host]
    _poll_until(lambda: not any(pid_alive(p.pid) for p in local), timeout_seconds)


def _poll_until(done: Callable[[], bool], timeout_seconds: float) -> None:
    """Return once ``done()`` is true (polled every 50 ms) or after ``timeout_seconds``."""
    deadline = time.monotonic() + timeout_seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def await_local_raising(store: Any, ranks: Sequence[int], me: int, timeout_seconds: float = 3.0) -> None:
    """Mark ``me`` as about to raise a peer failure and wait (at most ``timeout_seconds``) until
    every other rank among ``ranks`` on this host has marked itself too or has ended; then, at
    this process's hard exit, wait (at most 2 s) until those marked ranks have left their "exited"
    mark or ended. Never raises.

    A launcher stops the other ranks of a host as soon as one exits. Without these waits a rank
    that lost the same peer a moment later would be stopped before it printed its own error: the
    first wait lets it reach its ``raise``, the second lets it print (an uncaught error is printed
    before the interpreter's exit handlers run, and the "exited" mark is written in them).
    """
    global _exit_wait
    with contextlib.suppress(Exception):  # the store may be gone with the failed peer
        store.set(_RAISING.format(rank=me), str(os.getpid()))
        store.add(_RAISING_COUNT, 1)
        host = socket.gethostname()
        local = [p for r in ranks if r != me and (p := _lookup(store, r)) is not None and p.host == host]
        _poll_until(lambda: not any(pid_alive(p.pid) and not _raising(store, p.rank) for p in local),
                    timeout_seconds)
        _exit_wait = (store, [p for p in local if _raising(store, p.rank)])
        _register_exit_wait()


def find_raising(store: Any, ranks: Sequence[int], me: int) -> list[Peer]:
    """The ranks among ``ranks`` other than ``me`` that are raising a peer failure (they called
    :func:`await_local_raising`): they are leaving, so a collective with them cannot complete.
    One store round trip while nobody is raising."""
    if int(store.add(_RAISING_COUNT, 0)) == 0:
        return []
    return [p for r in ranks if r != me and _raising(store, r) and (p := _lookup(store, r)) is not None]


def _raising(store: Any, rank: int) -> bool:
    return try_get(store, _RAISING.format(rank=rank)) is not None


@functools.cache
def _register_exit_wait() -> None:
    flush_before_hard_exit(_await_local_exits)


def _await_local_exits(timeout_seconds: float = 2.0) -> None:
    """At a hard exit: wait (bounded) until the ranks of :data:`_exit_wait` have left their
    "exited" mark (their error is printed by then) or ended."""
    if _exit_wait is None:
        return
    store, peers = _exit_wait
    with contextlib.suppress(Exception):  # the store may be gone
        _poll_until(lambda: not any(pid_alive(p.pid) and not _exited(store, p.rank) for p in peers),
                    timeout_seconds)


def describe_gone(what: str, gone: Sequence[Peer]) -> str:
    """The message for ranks that will never reach the collective ``what``."""
    names, verb = _named(gone), "has" if len(gone) == 1 else "have"
    return (
        f"{what} cannot complete: {names} {verb} exited (finished its script, raised an error, or "
        "called shutdown()) without reaching it. Every rank must run the same collectives in the "
        "same order. HINT: run this collective on every rank (e.g. compute a metric everywhere and "
        "print it on rank 0 only), or give it a ProcessSet of the ranks that call it; if the rank "
        "failed, its own output says why."
    )


def describe_failure(
    what: str, dead: Sequence[Peer], remote: Sequence[Peer], relayed: Sequence[Peer] = (),
    *, until: str = "before finishing this collective",
) -> str | None:
    """The message for a failed collective ``what``; ``None`` when nothing useful is known.

    ``until``: when the dead rank stopped, in words (another phrase where ``what`` is no
    collective).

    ``relayed``: those of ``dead`` that only left because they lost a peer themselves
    (:func:`stopped_for_peers`); they are named as such, not as the cause.
    """
    own = [p for p in dead if p not in relayed]
    if dead and not own:
        names, verb = _named(dead), "has" if len(dead) == 1 else "have"
        candidates = ", ".join(f"rank {p.rank} on {p.host}" for p in remote)
        elsewhere = f": one of the ranks on other hosts ({candidates}) died or cannot be reached" \
            if remote else ""
        return (
            f"{what} failed: {names} {verb} stopped because {'it' if len(dead) == 1 else 'they'} "
            f"lost a peer too, so the first failure is elsewhere{elsewhere}. HINT: the error of "
            f"{'that rank' if len(dead) == 1 else 'those ranks'} names the peer it lost; check the "
            "other hosts' output (hvdrun --output-filename DIR keeps one log per rank)."
        )
    dead = own
    if dead:
        names, verb = _named(dead), "is" if len(dead) == 1 else "are"
        return (
            f"{what} failed because {names} {verb} no longer running: it crashed, exited or was "
            f"killed {until}. HINT: its own output says why (hvdrun "
            "--output-filename DIR keeps one log per rank); if it finished normally, every rank "
            "must run the same collectives."
        )
    if remote:
        names = ", ".join(f"rank {p.rank} on {p.host}" for p in remote)
        return (
            f"{what} failed: a peer closed its connection, and every other rank on this host is "
            f"still running, so one of the ranks on other hosts ({names}) died. HINT: check "
            "their output (hvdrun --output-filename DIR keeps one log per rank)."
        )
    return None


def raise_if_peer_failed(store: Any, ranks: Sequence[int], me: int, what: str) -> None:
    """Raise :class:`RankFailedError` naming a peer among ``ranks`` that is known to be gone
    (its "exited" mark, or its process on this host has ended), as a failed collective would;
    return when none is known (a peer on another host that died without a mark is not).

    For a process told to stop from outside (the launcher's SIGTERM after another rank died):
    it then ends like a rank that lost a peer in a collective (exit status
    :data:`~hvd_trainer.comm.base.fatal.PEER_FAILED_EXIT_CODE`, after the dead rank's own exit).
    """
    try:
        dead, _remote = find_dead_peers(store, ranks, me)
        relayed = stopped_for_peers(store, dead)
    except RankFailedError:
        # raised by this same function in a signal handler that interrupted the lookup (the
        # launcher's SIGTERM arriving twice): that verdict stands, never swallow it
        raise
    except Exception:  # noqa: BLE001 - the store may be gone with the failed peer
        return
    message = describe_failure(what, dead, [], relayed, until="while this rank still ran") if dead else None
    if message is None:
        return
    wait_until_ended(dead)  # so the launcher sees the dead rank's own exit first
    exit_hard_at_exit(PEER_FAILED_EXIT_CODE)
    raise RankFailedError(message)

"""Name the rank that died when a collective's transport fails.

At init every rank publishes ``<host>|<pid>`` in the job's key-value store. When a gloo
collective fails (gloo reports only "Connection closed by peer" and an address), the surviving
ranks look up their peers and test the ones on their own host for liveness, so the error can say
*which* rank is gone. Peers on other hosts cannot be probed from here; they are listed as
candidates instead.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Peer", "publish", "find_dead_peers", "describe_failure"]

_KEY = "hvd/proc/{rank}"


@dataclass(frozen=True, slots=True)
class Peer:
    rank: int
    host: str
    pid: int


def publish(store: Any, rank: int) -> None:
    """Record this process's host and pid under its rank (one store write)."""
    store.set(_KEY.format(rank=rank), f"{socket.gethostname()}|{os.getpid()}")


def _lookup(store: Any, rank: int) -> Peer | None:
    from hvd_trainer.comm.checks import try_get

    value = try_get(store, _KEY.format(rank=rank))
    if value is None:
        return None
    host, _, pid = value.rpartition("|")
    return Peer(rank, host, int(pid))


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host (a zombie, killed but not yet reaped, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def find_dead_peers(
    store: Any, ranks: Sequence[int], me: int, *, grace_seconds: float = 1.0
) -> tuple[list[Peer], list[Peer]]:
    """Return ``(dead local peers, peers on other hosts)`` among ``ranks`` other than ``me``.

    A peer whose socket just closed may still be exiting, so local peers are re-probed for up
    to ``grace_seconds`` before being reported alive.
    """
    host = socket.gethostname()
    peers = [p for r in ranks if r != me and (p := _lookup(store, r)) is not None]
    local = [p for p in peers if p.host == host]
    remote = [p for p in peers if p.host != host]
    deadline = time.monotonic() + grace_seconds
    while True:
        dead = [p for p in local if not _alive(p.pid)]
        if dead or time.monotonic() >= deadline:
            return dead, remote
        time.sleep(0.05)


def describe_failure(what: str, dead: Sequence[Peer], remote: Sequence[Peer]) -> str | None:
    """The message for a failed collective ``what``; ``None`` when nothing useful is known."""
    if dead:
        names = ", ".join(f"rank {p.rank} (pid {p.pid} on {p.host})" for p in dead)
        verb = "is" if len(dead) == 1 else "are"
        return (
            f"{what} failed because {names} {verb} no longer running: it crashed, exited or was "
            "killed before finishing this collective. HINT: its own output says why (hvdrun "
            "--output-filename DIR keeps one log per rank)."
        )
    if remote:
        names = ", ".join(f"rank {p.rank} on {p.host}" for p in remote)
        return (
            f"{what} failed: a peer closed its connection, and every other rank on this host is "
            f"still running, so one of the ranks on other hosts ({names}) died. HINT: check "
            "their output (hvdrun --output-filename DIR keeps one log per rank)."
        )
    return None

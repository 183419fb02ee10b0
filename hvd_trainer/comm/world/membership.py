"""Nobody trains with a stranger: every rank proves at init that it holds the job's secret.

hvdrun makes a secret for every job (or takes the one the user exported on every host) and
hands it to the workers as ``HOROVOD_SECRET_KEY``; it is never printed. The rendezvous and the
job's TCPStore are plain TCP services, so a process that reaches the port (a torchrun agent
started with the same command by mistake, or anything else) could take a place in the job. At
``init`` each rank therefore writes ``<proof>|<host>|<pid>`` under its rank, where ``proof`` is
``HMAC-SHA256(secret, "hvd-join|<namespace>|<rank>")`` (``-`` without a secret), waits for every
rank's entry and checks them with its own secret:

* every entry is ``-`` and this rank has no secret: nothing to check (plain torchrun, tests);
* an entry does not match: :class:`JobSecretError` on this rank, naming the rank(s), host(s) and
  pid(s) that did not prove membership;
* this rank has no secret but others prove one: this rank is the stranger, and says so.

The proof binds the rank and the world's namespace, so an entry copied from another rank or an
earlier world does not verify. The secret itself never enters the store.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from hvd_trainer.comm.base.errors import JobSecretError
from hvd_trainer.comm.base.store import try_get

__all__ = ["SECRET_ENV", "proof", "check_membership", "strangers"]

SECRET_ENV = "HOROVOD_SECRET_KEY"
"""The job's secret, exported to every worker by hvdrun (Horovod keeps its own in
``_HOROVOD_SECRET_KEY``, made by horovodrun the same way)."""

_KEY = "hvd/join/{rank}"
_NONE = "-"


def proof(secret: str, namespace: str, rank: int) -> str:
    """The hex HMAC-SHA256 of ``rank`` in ``namespace`` under ``secret``."""
    message = f"hvd-join|{namespace}|{rank}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def strangers(entries: dict[int, str], secret: str | None, namespace: str) -> list[tuple[int, str, str]]:
    """``(rank, host, pid)`` of every entry whose proof does not verify under ``secret``."""
    bad = []
    for rank, value in sorted(entries.items()):
        given, _, rest = value.partition("|")
        host, _, pid = rest.partition("|")
        expected = proof(secret, namespace, rank) if secret else _NONE
        if not hmac.compare_digest(given, expected):
            bad.append((rank, host or "?", pid or "?"))
    return bad


def check_membership(
    store: Any, rank: int, size: int, namespace: str, *, environ: Mapping[str, str] | None = None,
    timeout_seconds: float = 60.0,
) -> None:
    """Publish this rank's proof and verify every rank's (see the module docstring).

    Args:
        store: the world's key-value store. rank, size: this rank and the world size.
        namespace: unique to this world and equal on every rank (the runtime's store prefix).
        environ: where ``HOROVOD_SECRET_KEY`` is read (default ``os.environ``).
        timeout_seconds: how long to wait for the other ranks' entries.

    Raises:
        JobSecretError: a rank did not prove that it holds this job's secret, or this rank has
            none while the others do.
    """
    env = os.environ if environ is None else environ
    secret = env.get(SECRET_ENV) or None
    mine = proof(secret, namespace, rank) if secret else _NONE
    store.set(_KEY.format(rank=rank), f"{mine}|{socket.gethostname()}|{os.getpid()}")
    keys = [_KEY.format(rank=r) for r in range(size)]
    store.wait(keys, timedelta(seconds=timeout_seconds))
    entries = {r: try_get(store, k) or "" for r, k in enumerate(keys)}
    if secret is None:
        if any(not v.startswith(_NONE + "|") for v in entries.values()):
            raise JobSecretError(
                f"rank {rank} on {socket.gethostname()} (pid {os.getpid()}) has no {SECRET_ENV}, but "
                "the other ranks of this job prove one: this process does not belong to the job it "
                "reached (same rendezvous address and id). HINT: start it with the job's hvdrun "
                f"command, with the same {SECRET_ENV} exported, or give it its own --port/--rdzv-id."
            )
        return
    bad = strangers(entries, secret, namespace)
    if bad:
        named = ", ".join(f"rank {r} (pid {pid} on {host})" for r, host, pid in bad)
        raise JobSecretError(
            f"{named} joined this job without its secret ({SECRET_ENV}): the job stops rather than "
            "train with a process that does not belong to it. HINT: stop whatever started that "
            "process (another hvdrun/torchrun with the same --port and command); in the same-line "
            f"mode export the same {SECRET_ENV} on every host before running hvdrun."
        )

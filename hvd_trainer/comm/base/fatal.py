"""What happens to a process whose transport is wedged.

After a :class:`~hvd_trainer.comm.base.errors.StallError` a collective is still in flight and will never
complete, and gloo's process group cannot be destroyed then: its destructor joins a worker thread
that waits forever for the missing rank. So the process would raise a clear error and then hang at
exit, and the launcher would never learn that it failed. :func:`exit_hard_at_exit` makes the
interpreter leave with status 1 right after the ``atexit`` handlers, before that destructor runs.

:func:`pid_alive` is the other side: whether a peer process on this host has ended.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "exit_hard_at_exit", "recovered", "flush_before_hard_exit", "pid_alive", "stopped_for_a_peer",
    "peer_failed", "PEER_FAILED_EXIT_CODE",
]

PEER_FAILED_EXIT_CODE = 75
"""Exit status of a rank that stopped because *another* rank failed (it raised
:class:`~hvd_trainer.comm.base.errors.RankFailedError`). ``hvdrun`` ranks such exits after the failure
that caused them, so it names the rank that failed first."""

_registered = False
_exit_code = 1
_peer_failed = False
_flushers: list[Callable[[], None]] = []


def flush_before_hard_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` (e.g. the timeline's final write) before a hard exit, too."""
    _flushers.append(fn)


def _hard_exit() -> None:
    for fn in _flushers:
        with contextlib.suppress(Exception):
            fn()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream must not keep us alive
            stream.flush()
    os._exit(_exit_code)


def exit_hard_at_exit(code: int = 1) -> None:
    """Once per process: end with ``os._exit(code)`` at interpreter exit (after other handlers).

    The first call's ``code`` is kept (1, or :data:`PEER_FAILED_EXIT_CODE` after a peer failed),
    except after :func:`recovered` (status 0), where a new failure's code replaces it.
    A call with :data:`PEER_FAILED_EXIT_CODE` is also recorded for :func:`peer_failed`.
    """
    global _registered, _exit_code, _peer_failed
    _peer_failed = _peer_failed or code == PEER_FAILED_EXIT_CODE
    if not _registered:
        _registered = True
        _exit_code = code
        # atexit runs handlers last-in first-out, so this one runs before those registered
        # earlier; what must still be written registers with flush_before_hard_exit().
        atexit.register(_hard_exit)
    elif _exit_code == 0:
        _exit_code = code


def recovered() -> None:
    """The process recovered in place from a peer's failure (in-process recovery built a new
    process group). The broken group may still be referenced (a failed collective's work, an
    exception's frames) and its destructor can wait forever for a peer behind a cut link, so the
    hard exit stays registered, but with the status the interpreter would have had: 0, or 1
    after an uncaught exception (recorded by a ``sys.excepthook`` wrapper installed here)."""
    global _exit_code, _peer_failed
    exit_hard_at_exit(0)
    _exit_code, _peer_failed = 0, False
    previous = sys.excepthook

    def record(kind: Any, value: Any, tb: Any) -> None:
        global _exit_code
        if _exit_code == 0:  # a later peer's failure keeps its own status
            _exit_code = 1
        previous(kind, value, tb)

    if getattr(previous, "__name__", "") != "record":
        sys.excepthook = record


def peer_failed() -> bool:
    """Whether the comm layer raised a peer's failure (``RankFailedError``,
    ``HostUnreachableError``) in this process since it started or last :func:`recovered`: in the
    current world, a peer is gone. Unlike :func:`stopped_for_a_peer` it also says so after an
    earlier in-process recovery, whose hard exit keeps its own status."""
    return _peer_failed


def stopped_for_a_peer() -> bool:
    """Whether this process is on its way out because *another* rank failed (it raised
    RankFailedError or HostUnreachableError, so its exit status will be
    :data:`PEER_FAILED_EXIT_CODE`)."""
    return _registered and _exit_code == PEER_FAILED_EXIT_CODE


def pid_alive(pid: int) -> bool:
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

"""Describe a worker failure in words: exit codes and signals, and which failure came first."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from hvd_trainer.comm import PEER_FAILED_EXIT_CODE

__all__ = ["PID_FILE", "describe_exit", "exit_status", "own_failures", "root_failure", "script_pid"]

PID_FILE = "pid.{rank}"
"""Name, in hvdrun's job directory, of the file where a rank's worker entry writes the pid of
the command it started (the process ``RankFailedError`` and the rank's own prints name; torchrun
knows only the entry's)."""


def describe_exit(exitcode: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL"`` (negative codes are signals, as in Popen)."""
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    if exitcode == PEER_FAILED_EXIT_CODE:
        return f"exit code {exitcode} (stopped because another rank failed)"
    return f"exit code {exitcode}"


def exit_status(exitcode: int) -> int:
    """Shell-style status for hvdrun: the exit code, or 128 + signal number (never 0)."""
    return 128 - exitcode if exitcode < 0 else max(exitcode, 1)


def root_failure(failures: dict[int, Any]) -> list[tuple[int, Any]]:
    """torchrun's ``{global rank: ProcessFailure}`` ordered root cause first.

    The root cause is the failure the agent did not cause itself: it stops the surviving
    workers with SIGTERM, which then show up as failures too (timestamps are whole seconds),
    and a rank that stopped because a peer failed exits with ``PEER_FAILED_EXIT_CODE``.
    """
    return sorted(
        failures.items(),
        key=lambda item: (
            item[1].exitcode in (-signal.SIGTERM, PEER_FAILED_EXIT_CODE), item[1].timestamp, item[0]
        ),
    )


def own_failures(ordered: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """The failures after the first one (``root_failure`` order) that are not the agent's or a
    peer's doing: a rank the agent SIGTERMed, or that stopped because a peer failed, is a victim,
    not a failure to blame on it ("the other ranks were stopped" covers it)."""
    return [(r, f) for r, f in ordered[1:] if f.exitcode not in (-signal.SIGTERM, PEER_FAILED_EXIT_CODE)]


def script_pid(job_dir: str | Path | None, rank: int, entry_pid: int) -> int:
    """The pid of rank ``rank``'s command, as its worker entry wrote it to ``job_dir``;
    ``entry_pid`` (torchrun's, the entry's own) when there is no such record."""
    if job_dir is None:
        return entry_pid
    try:
        return int((Path(job_dir) / PID_FILE.format(rank=rank)).read_text())
    except (OSError, ValueError):
        return entry_pid

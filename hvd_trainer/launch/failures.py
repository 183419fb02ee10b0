"""Describe a worker failure in words: exit codes and signals, and which failure came first."""

from __future__ import annotations

import signal
from typing import Any

from hvd_trainer.comm.base.fatal import PEER_FAILED_EXIT_CODE

__all__ = ["describe_exit", "exit_status", "root_failure"]


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

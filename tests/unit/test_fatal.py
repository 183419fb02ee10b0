"""The exit status a process leaves with after a peer's failure and an in-process recovery
(real interpreters: the hard exit runs at interpreter exit)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PRELUDE = "from hvd_trainer.comm.base.fatal import exit_hard_at_exit, recovered\n"


@pytest.mark.parametrize(("body", "status"), [
    ("exit_hard_at_exit(75)\n", 75),                                   # a peer failed: 75
    ("exit_hard_at_exit(75)\nrecovered()\n", 0),                      # recovered, then ended normally
    ("exit_hard_at_exit(75)\nrecovered()\nexit_hard_at_exit(75)\n", 75),  # a second peer failure
    ("exit_hard_at_exit(75)\nrecovered()\nraise ValueError('own bug')\n", 1),  # its own error
])
def test_status_after_a_recovery(body: str, status: int) -> None:
    proc = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, timeout=60)
    assert proc.returncode == status, proc.stderr

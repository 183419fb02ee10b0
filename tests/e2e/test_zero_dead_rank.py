"""A rank dying during ZeRO stage 2 on CPU, where the reduce-scatter and the parameter exchange
are point-to-point transfers waited for on a helper thread: the survivor still raises
``RankFailedError`` naming the dead rank and exits (status 75) within 30 s, instead of hanging
in the transfer or at interpreter exit."""

from __future__ import annotations

import pytest

from tests.e2e.hvdrun_helpers import fail_time, run_two_ranks

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("where", ["before_backward", "before_step"])
def test_zero2_survivor_raises_when_peer_is_sigkilled(where: str) -> None:
    procs, out0, out1, ended = run_two_ranks(["zero_fault_worker.py", where], OMP_NUM_THREADS="1")
    assert procs[1].returncode == -9, out1
    assert procs[0].returncode == 75, out0  # PEER_FAILED_EXIT_CODE
    assert "DONE 0" not in out0, out0
    pid1 = out1.split("PID 1 ")[1].split()[0]
    assert "RankFailedError" in out0 and f"rank 1 (pid {pid1} on" in out0, out0
    seconds = ended - fail_time(out1)
    print(f"SCENARIO zero2-{where}-sigkill: surviving rank exited {seconds:.1f} s after the kill")
    assert seconds < 30, out0

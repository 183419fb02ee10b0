"""A rank dying under a launcher without an agent (mpirun/srun style): the survivor's gloo
collective raises ``RankFailedError`` naming the dead rank instead of hanging, and it exits
non-zero within 30 s."""

from __future__ import annotations

from tests.e2e.hvdrun_helpers import fail_time, run_two_ranks


def test_survivor_raises_when_peer_is_sigkilled() -> None:
    procs, out0, out1, ended = run_two_ranks(["fault_worker.py", "sigkill", "1", "3"])
    assert procs[1].returncode == -9, out1
    assert procs[0].returncode == 75, out0  # PEER_FAILED_EXIT_CODE: stopped because a peer failed
    assert "Connection" in out0 and "RuntimeError" in out0, out0  # gloo: closed/reset by peer
    pid1 = out1.split("PID 1 ")[1].split()[0]
    assert "RankFailedError: allreduce (unnamed) (collective" in out0, out0
    assert f"because rank 1 (pid {pid1} on" in out0, out0
    seconds = ended - fail_time(out1)
    print(f"SCENARIO no-agent-sigkill: surviving rank exited {seconds:.1f} s after the kill")
    assert seconds < 30, out0

"""A rank dying under a launcher without an agent (mpirun/srun style): the survivor's gloo
collective raises ``RankFailedError`` naming the dead rank instead of hanging, and it exits
non-zero within 30 s."""

from __future__ import annotations

import subprocess
import sys
import time

from hvd_trainer.comm.world.world import free_port
from tests.e2e.hvdrun_helpers import ROOT, SCRIPTS, clean_env, fail_time


def test_survivor_raises_when_peer_is_sigkilled() -> None:
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, str(SCRIPTS / "fault_worker.py"), "sigkill", "1", "3"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        out1, _ = procs[1].communicate(timeout=120)
        out0, _ = procs[0].communicate(timeout=60)
        ended = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode == -9, out1
    assert procs[0].returncode == 75, out0  # PEER_FAILED_EXIT_CODE: stopped because a peer failed
    assert "Connection" in out0 and "RuntimeError" in out0, out0  # gloo: closed/reset by peer
    pid1 = out1.split("PID 1 ")[1].split()[0]
    assert "RankFailedError: allreduce (unnamed) (collective" in out0, out0
    assert f"because rank 1 (pid {pid1} on" in out0, out0
    seconds = ended - fail_time(out1)
    print(f"SCENARIO no-agent-sigkill: surviving rank exited {seconds:.1f} s after the kill")
    assert seconds < 30, out0

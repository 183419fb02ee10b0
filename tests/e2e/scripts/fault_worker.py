"""Worker for hvdrun fault tests: allreduce every step; FAIL_RANK fails at FAIL_STEP.

Usage: fault_worker.py MODE FAIL_RANK FAIL_STEP   (MODE: none | raise | sigkill | exit3 | exit0;
FAIL_RANK -1: every rank)
Every rank prints ``PID <rank> <pid>`` first so the test can check no process is left behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

import hvd_trainer as hvd


def listening_addresses(port: int) -> list[str]:
    """Addresses with a LISTEN socket on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:
                raw = bytes.fromhex(addr)
                if len(raw) == 4:
                    found.append(".".join(str(b) for b in reversed(raw)))
                else:
                    found.append("ipv6:" + addr)
    return sorted(found)


mode, fail_rank, fail_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
world = hvd.init(timeout_seconds=300)
print(f"PID {world.rank} {os.getpid()}", flush=True)
print(f"ENV {world.rank} fusion={os.environ.get('HOROVOD_FUSION_THRESHOLD')} "
      f"timeline={os.environ.get('HOROVOD_TIMELINE')}", flush=True)
if world.rank == 0:
    print(f"STORE_LISTEN {listening_addresses(int(os.environ['MASTER_PORT']))}", flush=True)
for step in range(8):
    if fail_rank in (world.rank, -1) and step == fail_step:
        print(f"FAIL_AT {time.time():.3f}", flush=True)
        if mode == "raise":
            raise RuntimeError(f"boom at step {step}")
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "exit3":
            sys.exit(3)
        if mode == "exit0":  # a rank that "finishes" early while the others still communicate
            sys.exit(0)
    total = hvd.allreduce(torch.ones(4), op=hvd.Sum)
    assert total[0].item() == world.size
print(f"DONE {world.rank}", flush=True)
hvd.shutdown()

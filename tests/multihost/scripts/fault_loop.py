"""Allreduce steps until killed or cut off (or ``FAULT_LOOP_STEPS`` steps): the workload of the
fault tests in tests/multihost.

Every rank prints ``step <n> on <host>`` every 10 steps; each step's allreduce of ones must sum
to the world size (so a stranger or a wrong world would show).
"""

from __future__ import annotations

import os
import socket
import time

import torch

import hvd_trainer.torch as hvd

hvd.init()
host = socket.gethostname()
print(f"ready rank {hvd.rank()} of {hvd.size()} on {host}", flush=True)
ones = torch.ones(256)
for step in range(int(os.environ.get("FAULT_LOOP_STEPS", "100000"))):
    total = hvd.allreduce(ones, op=hvd.Sum, name="ones")
    assert float(total[0]) == hvd.size(), float(total[0])
    if step % 10 == 0:
        print(f"step {step} on {host}", flush=True)
    time.sleep(0.02)
print(f"finished rank {hvd.rank()} on {host}", flush=True)

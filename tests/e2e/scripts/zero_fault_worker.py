"""Worker for the ZeRO fault test: a stage-2 training loop on CPU (point-to-point reduce-scatter
and parameter exchange); rank 1 SIGKILLs itself at step 3, at ``WHERE``.

Usage: zero_fault_worker.py WHERE   (WHERE: before_backward | before_step)
``before_backward``: rank 0 is left in the reduce-scatter; ``before_step``: in the exchange.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import hvd_trainer as hvd

where = sys.argv[1]
world = hvd.init(timeout_seconds=300)
print(f"PID {world.rank} {os.getpid()}", flush=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                            torch.nn.ReLU(), torch.nn.Linear(256, 4))
opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                               named_parameters=model.named_parameters(), zero_stage=2)
x, y = torch.randn(16, 64), torch.randint(0, 4, (16,))


def die_here(point: str, step: int) -> None:
    if world.rank == 1 and step == 3 and point == where:
        print(f"FAIL_AT {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


for step in range(8):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    die_here("before_backward", step)
    loss.backward()
    opt.synchronize()
    die_here("before_step", step)
    with opt.skip_synchronize():
        opt.step()
print(f"DONE {world.rank}", flush=True)
hvd.shutdown()

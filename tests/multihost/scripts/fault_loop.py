"""Allreduce steps until killed or cut off (or ``FAULT_LOOP_STEPS`` steps): the workload of the
fault tests in tests/multihost.

Every rank prints ``step <n> on <host>`` every 10 steps; each step's allreduce of ones must sum
to the world size (so a stranger or a wrong world would show). With ``FAULT_LOOP_STOP_FILE``,
the ranks also stop together at the first tenth step after that file appears on any host.
With ``FAULT_LOOP_ZERO=1`` each step is instead an Adam step of a small MLP through
``DistributedOptimizer(zero_stage=2)`` (reduce-scatter of the gradients, then the shards'
transfers), without the sleep, so a fault lands inside ZeRO's traffic.
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
stop_file = os.environ.get("FAULT_LOOP_STOP_FILE")
zero = os.environ.get("FAULT_LOOP_ZERO") == "1"
if zero:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(), zero_stage=2)
    x = torch.randn(8, 64)
for step in range(int(os.environ.get("FAULT_LOOP_STEPS", "100000"))):
    if zero:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    else:
        total = hvd.allreduce(ones, op=hvd.Sum, name="ones")
        assert float(total[0]) == hvd.size(), float(total[0])
    if step % 10 == 0:
        print(f"step {step} on {host}", flush=True)
        if stop_file is not None:
            seen = torch.tensor([float(os.path.exists(stop_file))])
            if float(hvd.allreduce(seen, op=hvd.Max, name="stop")[0]) > 0:
                break
    if not zero:
        time.sleep(0.02)
print(f"finished rank {hvd.rank()} on {host}", flush=True)

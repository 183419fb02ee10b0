"""A job whose last collective is a large broadcast from rank 0, over a slow link.

Rank 0's part of the last broadcast ends once its data is in the kernel's socket buffers; it
prints and exits while the other ranks are still receiving. Each rank prints
``DONE <rank> <seconds in the last broadcast> <wall clock at its end> <json>`` with the last
element and the sum it holds. Argument: the tensor's element count (float32).
"""

from __future__ import annotations

import json
import sys
import time

import torch

import hvd_trainer as hvd

hvd.init()
numel = int(sys.argv[1]) if len(sys.argv) > 1 else 4 * 1024 * 1024
t = torch.arange(numel, dtype=torch.float32) if hvd.rank() == 0 else torch.zeros(numel)
hvd.allreduce(torch.ones(1))  # every rank is in
for _ in range(2):  # new (previous, this) signature pairs: compared across ranks in the store
    hvd.broadcast_(t, 0)
t0 = time.monotonic()
hvd.broadcast_(t, 0)  # a known pair: not compared, so nothing from rank 0 in the store for it
values = json.dumps([float(t[-1]), float(t.double().sum())])
print(f"DONE {hvd.rank()} {time.monotonic() - t0:.2f} {time.time():.2f} {values}", flush=True)

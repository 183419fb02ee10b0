"""Rank 0 finishes; the last rank fails afterwards (exit status 3), once rank 0 has exited.

Each rank prints ``END <rank> <wall clock>`` before leaving.
"""

from __future__ import annotations

import sys
import time

import torch

import hvd_trainer as hvd
from hvd_trainer.comm.world.liveness import find_gone

hvd.init()
hvd.allreduce(torch.ones(1))
rank, store = hvd.rank(), hvd.get_world().runtime.store
if rank == hvd.size() - 1:
    while not find_gone(store, [0]):  # rank 0's "exited" mark: an event in the store, polled
        time.sleep(0.05)
    print(f"END {rank} {time.time():.2f} failing", flush=True)
    sys.exit(3)
print(f"END {rank} {time.time():.2f} finished", flush=True)

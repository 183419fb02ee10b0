"""A process set created before in-process recovery, used after it (the torch API).

Usage: inprocess_process_set.py   (under hvdrun -np 3 --min-np 2 --max-np 3)
Ranks 0 and 2 allreduce over the set ``[0, 2]`` every step, rank 1 over the whole job; slot 2
SIGKILLs itself at step 5 in its first start. After the survivors re-form the world (2 ranks,
renumbered), the set's group is gone: rank 0's next use must raise a clear ``CommValueError``
instead of running on another world's default group (which hung before).
"""

from __future__ import annotations

import os
import signal
import time

import torch

import hvd_trainer.torch as hvd
from hvd_trainer import elastic

respawn = int(os.environ.get("HVDRUN_RESPAWN_COUNT", "0"))
slot = int(os.environ["RANK"])
hvd.init()
pair = hvd.add_process_set([0, 2])
state = elastic.ObjectState(step=0)


@elastic.run
def train(state: elastic.ObjectState) -> None:
    while state.step < 30:
        if respawn == 0 and slot == 2 and state.step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        ones = torch.ones(3)
        if hvd.rank() in (0, 2):
            hvd.allreduce(ones, op=hvd.Sum, process_set=pair, name="pair")
        else:
            hvd.allreduce(ones, op=hvd.Sum, name="all")
        time.sleep(0.05)
        state.step += 1
        state.commit()


train(state)
print(f"DONE slot={slot}", flush=True)

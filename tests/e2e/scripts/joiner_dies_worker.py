"""In-process recovery worker: the restarted rank is lost again *while it joins*.

Slot 1 SIGKILLs itself at step 10 of its first start; its second start (``HVDRUN_RESPAWN_COUNT=1``)
SIGKILLs itself right after ``hvd.init()`` (the survivor is then in the join's state sync); its
third start joins; the job runs on until it did (at least 60 steps). Each rank prints
``DONE ... sum=<weights checksum>``.
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
hvd.init()  # a restarted worker is let in here, at the survivor's next commit
if slot == 1 and respawn == 1:
    print(f"JOINER_DIES t={time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
state = elastic.TorchState(model, optimizer, step=0)
STEPS = 60


@elastic.run
def train(state: elastic.TorchState) -> None:
    while state.step < STEPS or hvd.size() < 2:  # ends with the third start of slot 1 in the world
        if slot == 1 and respawn == 0 and state.step == 10:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)
        optimizer.zero_grad()
        model(torch.full((4, 256), float(state.step))).sum().backward()
        optimizer.step()
        state.step += 1
        state.commit()


train(state)
checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
print(f"DONE slot={slot} respawn={respawn} step={state.step} size={hvd.size()} sum={checksum:.12e}",
      flush=True)

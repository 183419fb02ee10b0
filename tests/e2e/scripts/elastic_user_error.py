"""Elastic worker for hvdrun's retry policy: what a failure at step 2 does under restarts.

Usage: elastic_user_error.py MODE COUNT_DIR   (MODE: user | sigkill | none)
``user``: rank 1 raises ``ValueError("bad batch 2")`` in every attempt (a deterministic bug);
``sigkill``: rank 1 SIGKILLs itself at step 2 in the first attempt only (a peer's failure).
Every attempt of every rank touches ``COUNT_DIR/attempt.<restart>.<rank>`` so the test can count
the attempts that ran.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

import hvd_trainer as hvd
from hvd_trainer import elastic

mode, count_dir = sys.argv[1], Path(sys.argv[2])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
model = torch.nn.Linear(2, 1)
state = elastic.TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), step=0)


@elastic.run
def train(state: elastic.TorchState) -> None:
    rank = hvd.rank()
    (count_dir / f"attempt.{attempt}.{rank}").touch()
    while state.step < 4:
        if rank == 1 and state.step == 2 and mode == "user":
            raise ValueError(f"bad batch {state.step}")
        if rank == 1 and state.step == 2 and mode == "sigkill" and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.allreduce(torch.ones(1), name=f"step{state.step}")
        state.step += 1
        state.commit()


train(state)
print(f"DONE {hvd.rank()} step={state.step}", flush=True)
hvd.shutdown()

"""Elastic worker for host loss across namespace hosts: 3 epochs, a commit every 3 steps.

Usage: elastic_hosts.py RUN_DIR OUT_FILE
Each host keeps its commits in ``RUN_DIR/<hostname>`` (its own "disk"). Every step prints
``STEP <step> rank=<r> world=<n> host=<h>``; a short sleep per step leaves time to kill a host
mid-epoch (``ELASTIC_STEP_SLEEP`` seconds, default 0.15; 0 for a reference run that nobody
interrupts). ``ELASTIC_HOLD_FILE``: every rank waits after step ``ELASTIC_HOLD_STEP`` (default
14) while that file exists, in a world of ``ELASTIC_HOLD_WORLD`` ranks only if that is set (the
test holds the job until a spare or a returning host has reached it). Rank 0 saves the final
weights and the per-step sample indices to OUT_FILE.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import hvd_trainer as hvd
from hvd_trainer import elastic

run_dir, out_file = sys.argv[1], sys.argv[2]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
host = socket.gethostname()
torch.manual_seed(0)
N, BATCH, EPOCHS, COMMIT_EVERY = 192, 4, 3, 3
STEP_SLEEP = float(os.environ.get("ELASTIC_STEP_SLEEP", "0.15"))
HOLD_FILE = os.environ.get("ELASTIC_HOLD_FILE")
HOLD_STEP = int(os.environ.get("ELASTIC_HOLD_STEP", "14"))
HOLD_WORLD = int(os.environ.get("ELASTIC_HOLD_WORLD", "0"))  # 0: any world size
dataset = TensorDataset(torch.randn(N, 4), torch.randn(N, 1), torch.arange(N))
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=1)
loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
state = elastic.TorchState(model, optimizer, epoch=0, step=0, seen=[], sampler=sampler)


@elastic.run(checkpoint_dir=os.path.join(run_dir, host))
def train(state: elastic.TorchState) -> None:
    world = hvd.get_world()
    print(f"START rank={world.rank} world={world.size} host={host} attempt={attempt} "
          f"step={state.step} epoch={state.epoch} at={time.time():.3f}", flush=True)
    for epoch in range(state.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y, idx) in enumerate(loader):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for p in model.parameters():
                hvd.allreduce_(p.grad)  # average over ranks
            optimizer.step()
            sampler.record_batch(i, BATCH)
            state.step += 1
            state.seen.append((epoch, sorted(hvd.allgather(idx).tolist())))
            print(f"STEP {state.step} rank={world.rank} world={world.size} host={host}", flush=True)
            if state.step % COMMIT_EVERY == 0:
                state.commit()
                print(f"COMMIT {state.step} rank={world.rank}", flush=True)
            held = HOLD_FILE and state.step == HOLD_STEP and HOLD_WORLD in (0, world.size)
            while held and os.path.exists(HOLD_FILE):
                time.sleep(0.05)
            if STEP_SLEEP > 0:
                time.sleep(STEP_SLEEP)
        state.epoch = epoch + 1
        state.commit()


train(state)
if hvd.rank() == 0:
    torch.save({"model": model.state_dict(), "seen": state.seen, "step": state.step}, out_file)
print(f"DONE rank={hvd.rank()} world={hvd.size()} host={host} step={state.step}", flush=True)
hvd.shutdown()

"""Elastic training worker: 2 ranks, 3 epochs of 8 steps, commits every 3 steps.

Usage: elastic_worker.py RUN_DIR OUT_FILE KILL_STEP  (RUN_DIR "default": the automatic directory)
On the first attempt (TORCHELASTIC_RESTART_COUNT=0) rank 1 SIGKILLs itself when
``state.step == KILL_STEP`` (-1: never). Rank 0 saves the final weights and the committed
per-step sample indices to OUT_FILE.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import hvd_trainer as hvd
from hvd_trainer import elastic

run_dir, out_file, kill_step = sys.argv[1], sys.argv[2], int(sys.argv[3])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
N, BATCH, EPOCHS, COMMIT_EVERY = 64, 4, 3, 3
dataset = TensorDataset(torch.randn(N, 4), torch.randn(N, 1), torch.arange(N))
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=1)
loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
state = elastic.TorchState(model, optimizer, epoch=0, step=0, seen=[], sampler=sampler)


@elastic.run(checkpoint_dir=None if run_dir == "default" else run_dir)  # "default": <tmp>/hvd_trainer_elastic
def train(state: elastic.TorchState) -> None:
    world = hvd.get_world()
    print(f"PID {world.rank} {os.getpid()}", flush=True)
    print(f"START rank={world.rank} attempt={attempt} step={state.step} epoch={state.epoch} "
          f"at={time.time():.3f}", flush=True)
    for epoch in range(state.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y, idx) in enumerate(loader):
            if attempt == 0 and world.rank == 1 and state.step == kill_step:
                print(f"FAIL_AT {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for p in model.parameters():
                hvd.allreduce_(p.grad)  # average over ranks
            optimizer.step()
            sampler.record_batch(i, BATCH)
            state.step += 1
            state.seen.append((epoch, sorted(hvd.allgather(idx).tolist())))
            if state.step % COMMIT_EVERY == 0:
                state.commit()
        state.epoch = epoch + 1
        state.commit()


train(state)
if hvd.rank() == 0:
    torch.save({"model": model.state_dict(), "seen": state.seen, "step": state.step}, out_file)
print(f"DONE rank={hvd.rank()} step={state.step}", flush=True)
hvd.shutdown()

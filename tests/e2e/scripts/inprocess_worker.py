"""In-process recovery worker (torch API): commits every step; rank 1 SIGKILLs itself once.

Usage: inprocess_worker.py OUT_FILE KILL_STEP [STEP_SLEEP_S [SAMPLES]]
In its first start (``HVDRUN_RESPAWN_COUNT=0``) slot ``KILL_SLOT`` (environment, default 1)
SIGKILLs itself when ``state.step == KILL_STEP`` (-1: never). ``ZERO_STAGE`` (environment, default
0): 1 or 2 shards Adam's state (lr 0.01) with ZeRO; else SGD with momentum. Every committed step records the
world size and each rank's sample indices, so the test can replay the same steps in one process.
Rank 0 saves the final weights, that history and the steps' completion times to OUT_FILE. A
restarted worker prints ``JOINER boot= imported= joined= first_step=`` (epoch seconds): its
interpreter's start of this script, torch and hvd_trainer imported, ``hvd.init()`` returned (it
joined), its first step done. ``WAIT_FOR_JOINER=1``: a survivor alone (a world smaller than the
launch's) waits after its next commit until the restarted worker has arrived (at most 90 s), so
a short job cannot end before a loaded machine has started the joiner. ``RESTART_DELAY_S``: a
restarted worker first sleeps that long (a replacement that comes back late).
"""

from __future__ import annotations

import os
import signal
import sys
import time

if int(os.environ.get("HVDRUN_RESPAWN_COUNT", "0")) > 0:  # a replacement that comes back late
    time.sleep(float(os.environ.get("RESTART_DELAY_S", "0")))
BOOT = time.time()  # a restarted worker reports where its time went before its first step
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import hvd_trainer.torch as hvd  # noqa: E402
from hvd_trainer import elastic  # noqa: E402
from hvd_trainer.comm import HostsUpdatedInterrupt, reform_due  # noqa: E402

out_file, kill_step = sys.argv[1], int(sys.argv[2])
step_sleep = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
respawn = int(os.environ.get("HVDRUN_RESPAWN_COUNT", "0"))
slot = int(os.environ["RANK"])
kill_slot = int(os.environ.get("KILL_SLOT", "1"))
launch_size = int(os.environ["WORLD_SIZE"])
wait_for_joiner = os.environ.get("WAIT_FOR_JOINER") == "1"
IMPORTED = time.time()
hvd.init()  # as in Horovod's elastic examples (a restarted worker joins here)
JOINED = time.time()
torch.manual_seed(0)
N, BATCH, EPOCHS = int(sys.argv[4]) if len(sys.argv) > 4 else 128, 4, 2
dataset = TensorDataset(torch.randn(N, 4), torch.randn(N, 1), torch.arange(N))
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
zero_stage = int(os.environ.get("ZERO_STAGE", "0"))  # with ZeRO: Adam, whose state is sharded
inner = (torch.optim.Adam(model.parameters(), lr=0.01) if zero_stage else
         torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
optimizer = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), zero_stage=zero_stage)
sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=1)
loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
state = elastic.TorchState(model, optimizer, epoch=0, step=0, history=[], sampler=sampler)
done_at: list[float] = []


def _await_joiner() -> None:
    """Alone: poll the step-boundary check until the restarted worker has arrived, then leave
    for the re-form as a commit would."""
    deadline = time.monotonic() + 90.0
    while time.monotonic() < deadline:
        if reform_due():
            raise HostsUpdatedInterrupt(skip_sync=False)
        time.sleep(0.05)


@elastic.run
def train(state: elastic.TorchState) -> None:
    print(f"START slot={slot} pid={os.getpid()} rank={hvd.rank()} size={hvd.size()} respawn={respawn} "
          f"step={state.step}", flush=True)
    for epoch in range(state.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y, idx) in enumerate(loader):
            if respawn == 0 and slot == kill_slot and state.step == kill_step:
                print(f"FAIL_AT {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(step_sleep)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            sampler.record_batch(i, BATCH)
            state.step += 1
            state.history.append((epoch, hvd.allgather_object(idx.tolist())))
            done_at.append(time.time())
            if respawn > 0 and len(done_at) == 1:
                print(f"JOINER boot={BOOT:.3f} imported={IMPORTED:.3f} joined={JOINED:.3f} "
                      f"first_step={done_at[0]:.3f}", flush=True)
            print(f"STEP {state.step} rank={hvd.rank()} size={hvd.size()}", flush=True)
            state.commit()
            if wait_for_joiner and hvd.size() < launch_size:
                _await_joiner()
        state.epoch = epoch + 1
        state.commit()


train(state)
if hvd.rank() == 0:
    torch.save({"model": model.state_dict(), "history": state.history, "step": state.step,
                "done_at": done_at}, out_file)
print(f"DONE slot={slot} pid={os.getpid()} rank={hvd.rank()} size={hvd.size()} step={state.step}", flush=True)

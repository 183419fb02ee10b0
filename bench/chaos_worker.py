"""Worker of bench/elastic_chaos.py: a small GPT trained with the torch API, elastic.

Run by the bench through hvdrun (never by hand)::

    hvdrun -np 2 [--min-np 1 --max-np 2 --recovery in-process] python bench/chaos_worker.py \
        CHAOS_DIR COMMIT_EVERY

``TorchState`` + ``hvd.DistributedOptimizer`` (AdamW) + ``ElasticSampler`` under
``@elastic.run``; ``state.commit()`` every ``COMMIT_EVERY`` steps (1: the in-process and restart
paths; N: "a checkpoint file every N steps"). The bench kills the workers from outside by the
pids they print; this script only reports:

- ``CHAOS_START slot= pid= respawn= restart= t=``: the process is up (after any restart delay);
- ``CHAOS_FIRST slot= pid= step= size= t=``: this process completed its first step;
- ``CHAOS_STEP slot= pid= step= size= t=``: each later completed step;
- ``CHAOS_DONE slot= step=``: the function returned (the bench asked it to stop).

Restart delay (a replacement machine that comes back late): when ``CHAOS_DIR/delay.<slot>``
exists at start, the process removes it and sleeps that many seconds before anything else. The
bench writes it just before it kills that slot, so only the killed slot's next process waits,
whichever path restarts it. Stopping: the bench creates ``CHAOS_DIR/stop``; each step gathers
every rank's view of it with the sample indices, so all ranks stop after the same step. Slot 0
then saves the weights, the step count and the per-step history (epoch and each rank's sample
indices, as JSON lines in one ``bytes`` value: O(1) to snapshot at every commit) to
``CHAOS_DIR/final.pt`` for the bench's one-process replay (:func:`replay`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VOCAB, BLOCK, LAYERS, HEADS, EMBD = 256, 64, 4, 4, 128
N_SAMPLES, BATCH, LR = 1024, 8, 3e-4


def build():  # noqa: ANN201 - torch is imported lazily (the start time is taken before it)
    """Model, optimizer and token windows, built identically in the workers and the replay."""
    import torch

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from recipes._gpt_model import GPT, GPTShape

    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=VOCAB, block_size=BLOCK, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD,
                         dropout=0.0))
    tokens = torch.randint(0, VOCAB, (N_SAMPLES, BLOCK + 1), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return model, optimizer, tokens


def loss_of(model, tokens):  # noqa: ANN001, ANN201
    import torch

    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def replay(history: list[tuple[int, list[list[int]]]]):  # noqa: ANN201
    """The steps of ``history`` in one process: each step's gradient is the ranks' gradients
    over their own samples, summed in rank order and divided by the world size (what the
    allreduce computes). Returns the final ``state_dict``."""
    import torch

    model, optimizer, tokens = build()
    for _, per_rank in history:
        grads = []
        for indices in per_rank:
            model.zero_grad()
            loss_of(model, tokens[indices]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            total = grads[0][i].clone()
            for g in grads[1:]:
                total += g[i]
            p.grad = total / len(per_rank)
        optimizer.step()
    with torch.no_grad():
        return {k: v.clone() for k, v in model.state_dict().items()}


def _restart_delay(chaos_dir: Path, slot: int) -> None:
    marker = chaos_dir / f"delay.{slot}"
    try:
        delay = float(marker.read_text())
    except (OSError, ValueError):
        return
    marker.unlink(missing_ok=True)
    time.sleep(delay)


def main() -> None:  # noqa: C901 - one training loop, read top to bottom
    chaos_dir, commit_every = Path(sys.argv[1]), int(sys.argv[2])
    slot = int(os.environ["RANK"])
    _restart_delay(chaos_dir, slot)
    print(f"CHAOS_START slot={slot} pid={os.getpid()} respawn={os.environ.get('HVDRUN_RESPAWN_COUNT', '0')} "
          f"restart={os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} t={time.time():.4f}", flush=True)
    import json

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import hvd_trainer.torch as hvd
    from hvd_trainer import elastic

    torch.set_num_threads(1)
    hvd.init()  # as in Horovod's elastic examples (a restarted worker joins in @elastic.run)
    model, base_optimizer, tokens = build()
    optimizer = hvd.DistributedOptimizer(base_optimizer, named_parameters=model.named_parameters())
    dataset = TensorDataset(tokens, torch.arange(N_SAMPLES))
    sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=2)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    state = elastic.TorchState(model, optimizer, epoch=0, step=0, history=b"", stopped=False, sampler=sampler)
    stop_file = chaos_dir / "stop"
    first = [True]  # until this process completed a step

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        while not state.stopped:
            epoch = state.epoch
            sampler.set_epoch(epoch)
            for i, (x, idx) in enumerate(loader):
                optimizer.zero_grad()
                loss_of(model, x).backward()
                optimizer.step()
                sampler.record_batch(i, BATCH)
                gathered = hvd.allgather_object((idx.tolist(), stop_file.exists()))
                state.step += 1
                state.history += json.dumps([epoch, [g[0] for g in gathered]]).encode() + b"\n"
                state.stopped = any(g[1] for g in gathered)
                tag = "CHAOS_FIRST" if first else "CHAOS_STEP"
                first.clear()
                print(f"{tag} slot={slot} pid={os.getpid()} step={state.step} size={hvd.size()} "
                      f"t={time.time():.4f}", flush=True)
                if state.stopped:
                    state.commit()
                    return
                if state.step % commit_every == 0:
                    state.commit()
            state.epoch = epoch + 1  # committed with the next step's commit (the sampler is at the end)

    train(state)
    print(f"CHAOS_DONE slot={slot} step={state.step}", flush=True)
    if slot == 0:
        history = [json.loads(line) for line in state.history.decode().splitlines()]
        torch.save({"model": model.state_dict(), "step": state.step, "history": history},
                   chaos_dir / "final.pt")


if __name__ == "__main__":
    main()

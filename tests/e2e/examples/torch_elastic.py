"""What Horovod's examples/elastic/pytorch/pytorch_mnist_elastic.py does, with hvd_trainer's import.

``hvd.elastic.ElasticSampler`` shards the data; ``hvd.elastic.TorchState(model, optimizer,
train_sampler=..., epoch=..., batch=...)`` is committed every few batches inside a
``@hvd.elastic.run`` training function, which records each batch on the sampler; an
``on_reset`` callback rescales the LR by the new ``hvd.size()``. Runs under plain ``-np 2`` and
under ``--min-np 2 --max-np 2 --max-restarts 1`` (nothing fails: no restart).
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data as tud

import hvd_trainer.torch as hvd  # was: import horovod.torch as hvd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from standin import mnist, report  # noqa: E402

BATCH, EPOCHS, COMMIT_EVERY = 16, 2, 4


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(hvd.rank())
    x, y = mnist(256, seed=1)
    dataset = tud.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=False)
    train_loader = tud.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.5)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    losses: list[float] = []

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        for epoch in range(state.epoch, EPOCHS + 1):
            state.epoch = epoch
            state.train_sampler.set_epoch(epoch)
            for batch_idx, (data, target) in enumerate(train_loader):
                state.batch = batch_idx
                optimizer.zero_grad()
                loss = F.cross_entropy(model(data), target)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                state.train_sampler.record_batch(batch_idx, BATCH)
                if batch_idx % COMMIT_EVERY == 0:
                    state.commit()
            state.batch = 0

    def on_state_reset() -> None:
        for group in optimizer.param_groups:
            group["lr"] = 0.05 * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=1, batch=0)
    state.register_reset_callbacks([on_state_reset])
    train(state)
    report("torch_elastic", hvd.rank(), losses=losses, epoch=state.epoch, commits=state.commit_count,
           weights=torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())


if __name__ == "__main__":
    main()

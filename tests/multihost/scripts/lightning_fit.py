"""Lightning ``Trainer(strategy="horovod").fit`` across hosts; weights == one process on the global batch.

Each rank prints ``WEIGHTS <rank> <world> <json>``; rank 0 also prints ``REFERENCE <json>``: the
same model trained by a plain torch loop in one process on the global batches. Each rank loads
its own shard (``use_distributed_sampler=False``: Lightning's sampler always shuffles training
data): step k of rank r is rows ``[k*G + r*BATCH, k*G + (r+1)*BATCH)`` with ``G = BATCH*world``.
"""

from __future__ import annotations

import json
import os

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import hvd_trainer  # noqa: F401  (registers strategy="horovod")

BATCH, EPOCHS, LR, ROWS = 2, 2, 0.1, 32


def _net() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _flat(net: torch.nn.Module) -> list[float]:
    return [round(float(v), 6) for v in torch.cat([p.detach().flatten() for p in net.parameters()])]


def _reference(x: torch.Tensor, y: torch.Tensor, world: int) -> list[float]:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    g = BATCH * world
    for _ in range(EPOCHS):
        for k in range(ROWS // g):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x[k * g:(k + 1) * g]), y[k * g:(k + 1) * g]).backward()
            opt.step()
    return _flat(net)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(ROWS, 3, generator=g), torch.randn(ROWS, 1, generator=g)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    g = BATCH * world
    mine = torch.cat([torch.arange(k * g + rank * BATCH, k * g + (rank + 1) * BATCH)
                      for k in range(ROWS // g)])
    trainer = pl.Trainer(strategy="horovod", accelerator="cpu", max_epochs=EPOCHS, logger=False,
                         use_distributed_sampler=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    model = Regressor()
    trainer.fit(model, DataLoader(TensorDataset(x[mine], y[mine]), batch_size=BATCH))
    assert (trainer.global_rank, trainer.world_size) == (rank, world)
    print(f"WEIGHTS {rank} {world} {json.dumps(_flat(model.net))}", flush=True)
    if rank == 0:
        print(f"REFERENCE {json.dumps(_reference(x, y, world))}", flush=True)

if __name__ == "__main__":
    main()

"""A ``LightningCLI`` program, as Lightning's own examples are written: no hvd_trainer line.

Run as ``hvdrun -np 2 python lightning_cli.py fit --trainer.strategy=horovod ...``: the strategy
name comes from the command line and must resolve in a program that never imported hvd_trainer.
``LightningCLI``'s config-saving callback writes ``config.yaml`` into the log directory (rank 0).
"""

from __future__ import annotations

import os
import sys

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torch.utils.data as tud
from pytorch_lightning.cli import LightningCLI

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from standin import mnist, report  # noqa: E402


class Net(pl.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(int(os.environ.get("RANK", "0")))  # rank-dependent: the strategy broadcasts
        self.lr = lr
        self.fc = torch.nn.Linear(784, 10)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.fc(x.flatten(1)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def on_train_end(self) -> None:
        report("lightning_cli", int(os.environ["RANK"]), strategy=type(self.trainer.strategy).__name__,
               world_size=self.trainer.world_size, hvd_trainer_imported="hvd_trainer.strategy" in sys.modules,
               weights=torch.cat([p.detach().flatten() for p in self.parameters()]).tolist())


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> tud.DataLoader:
        x, y = mnist(128, seed=1)
        return tud.DataLoader(tud.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
                              batch_size=self.batch_size)


if __name__ == "__main__":
    LightningCLI(Net, Data)

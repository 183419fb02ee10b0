"""What Horovod's examples/pytorch/pytorch_lightning_mnist.py does, on Lightning 2.x.

Changed as the README's "Porting from Horovod" table says: ``Trainer(accelerator='horovod',
gpus=...)`` -> ``Trainer(strategy="horovod", accelerator="cpu")``, ``validation_epoch_end`` ->
``on_validation_epoch_end``, the callback's ``on_epoch_end`` -> ``on_train_epoch_end``. The
example's test loop afterwards averages with ``hvd.allreduce`` as in the torch example.
"""

from __future__ import annotations

import sys
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data as tud

import hvd_trainer.torch as hvd  # was: import horovod.torch as hvd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from standin import mnist, report  # noqa: E402


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=5)
        self.conv2 = nn.Conv2d(4, 8, kernel_size=5)
        self.fc1 = nn.Linear(128, 32)
        self.fc2 = nn.Linear(32, 10)
        self.val_losses: list[torch.Tensor] = []
        self.epoch_val_loss: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.flatten(1)))), dim=1)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.nll_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(F.nll_loss(self(x), y))

    def on_validation_epoch_end(self) -> None:  # was: validation_epoch_end(self, outputs)
        avg = torch.stack(self.val_losses).mean()
        self.val_losses.clear()
        self.log("val_loss", avg, sync_dist=True)
        self.epoch_val_loss.append(float(self.trainer.strategy.reduce(avg.detach().clone())))


class EpochCounter(pl.Callback):
    def __init__(self) -> None:
        self.epochs = 0
        self.train_end = False

    # was: on_epoch_end
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_end = True


def loader(n: int, seed: int) -> tud.DataLoader:
    x, y = mnist(n, seed)
    return tud.DataLoader(tud.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=16)


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(hvd.rank())
    model = Net()
    counter = EpochCounter()
    trainer = pl.Trainer(strategy="horovod", accelerator="cpu", callbacks=[counter], max_epochs=3,
                         limit_train_batches=0.5, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, loader(512, seed=1), loader(128, seed=2))
    correct = torch.tensor(0.0)
    with torch.no_grad():
        for x, y in loader(64, seed=3):
            correct += model(x).argmax(1).eq(y).float().sum()
    accuracy = hvd.allreduce(correct / 64, name="avg_accuracy").item()
    report("lightning_mnist", hvd.rank(), strategy=type(trainer.strategy).__name__,
           world_size=trainer.world_size, epochs=counter.epochs, train_end=counter.train_end,
           val_loss=model.epoch_val_loss, accuracy=accuracy,
           weights=torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())


if __name__ == "__main__":
    main()

"""A Lightning job whose rank 1 stops calling collectives (sleeps) at step 3.

With ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` set, rank 0 raises ``StallError`` naming rank 1 and
must then *exit* (gloo cannot tear down a group with a collective in flight), so hvdrun stops the
job instead of hanging.
"""

from __future__ import annotations

import time

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hvd_trainer  # noqa: F401  (registers strategy="horovod")


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        if self.global_rank == 1 and batch_idx == 3:
            print(f"STALL rank 1 at {time.time():.3f}", flush=True)
            time.sleep(600)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
pl.Trainer(
    strategy="horovod", max_epochs=1, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
).fit(Net(), DataLoader(data, batch_size=4))

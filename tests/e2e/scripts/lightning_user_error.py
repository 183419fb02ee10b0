"""Lightning under hvdrun restarts: a callback that raises in ``on_train_end`` on rank 1.

Usage: lightning_user_error.py COUNT_DIR
Every attempt of every rank touches ``COUNT_DIR/attempt.<restart>.<rank>``. The error is the
user's own (deterministic): the job must fail at once, not be restarted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_trainer.strategy import HorovodStrategy

COUNT_DIR = Path(sys.argv[1])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class FailsAtTrainEnd(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (COUNT_DIR / f"attempt.{ATTEMPT}.{trainer.global_rank}").touch()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 1:
            raise RuntimeError("report upload failed: no such bucket")


def main() -> None:
    data = TensorDataset(torch.randn(16, 2), torch.randn(16, 1))
    trainer = pl.Trainer(
        strategy=HorovodStrategy(elastic_commit_every_n_steps=2), accelerator="cpu", devices=2,
        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[FailsAtTrainEnd()],
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))
    print(f"DONE rank={trainer.global_rank}", flush=True)


if __name__ == "__main__":
    main()

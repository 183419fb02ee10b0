"""Elastic Lightning worker: ``Trainer(strategy="horovod")`` resumes by itself after a restart.

Usage: lightning_elastic.py OUT_FILE KILL_STEP
2 ranks, 3 epochs of 8 steps (64 samples, batch 4 per rank), a model with dropout (each rank
draws its own masks from its own RNG, seeded per rank), SGD with momentum and an epoch-wise
StepLR, commits every 3 optimizer steps (elastic mode is on when hvdrun was given
--min-np/--max-np or --max-restarts). On the first attempt rank 1 SIGKILLs itself before
optimizer step ``KILL_STEP + 1`` (-1: never). Rank 0 saves the final weights and the per-step
sample indices of both ranks (kept in the checkpoints, so a resumed run has the committed ones)
to OUT_FILE.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_trainer.strategy import HorovodStrategy

OUT_FILE, KILL_STEP = sys.argv[1], int(sys.argv[2])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
N, BATCH, EPOCHS, COMMIT_EVERY = 64, 4, 3, 3


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 1))
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.seen.append((self.current_epoch, sorted(self.all_gather(idx).flatten().tolist())))
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["seen"] = list(self.seen)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.seen = list(checkpoint["seen"])


class Report(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        print(f"PID {trainer.global_rank} {os.getpid()}", flush=True)
        print(f"START rank={trainer.global_rank} attempt={ATTEMPT} step={trainer.global_step} "
              f"epoch={trainer.current_epoch} at={time.time():.3f}", flush=True)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if ATTEMPT == 0 and trainer.global_rank == 1 and trainer.global_step == KILL_STEP:
            print(f"FAIL_AT {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g), torch.arange(N))
    trainer = pl.Trainer(
        strategy=HorovodStrategy(elastic_commit_every_n_steps=COMMIT_EVERY), accelerator="cpu",
        devices=2, max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Report()],
    )
    model = Regressor()
    torch.manual_seed(100 + int(os.environ.get("RANK", "0")))  # per-rank dropout masks
    trainer.fit(model, DataLoader(data, batch_size=BATCH, shuffle=True))
    if trainer.global_rank == 0:
        torch.save({"model": model.state_dict(), "seen": model.seen, "step": trainer.global_step}, OUT_FILE)
    print(f"DONE rank={trainer.global_rank} step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()

"""In-process recovery of ``Trainer(strategy=HorovodStrategy())`` under ``hvdrun --recovery in-process``.

Usage: lightning_inprocess.py OUT_DIR MODE   (MODE: kill | user | cli | zero)
2 ranks, 64 samples, batch 4 per rank, 4 epochs (8 steps each on 2 ranks), commits every 2
optimizer steps (elastic mode is on by itself under in-process recovery).
``kill``: in its first start (``HVDRUN_RESPAWN_COUNT=0``) slot 1 SIGKILLs itself before optimizer
step ``KILL_STEP + 1``; hvdrun's worker entry starts it again alone and it joins the survivor at
a commit. ``user``: rank 1 raises ``ValueError`` in ``training_step`` at global step 2.
``cli``: ``kill`` with the Trainer, model and data built by ``LightningCLI`` (``run=False``), so
its config-saving callback (``SaveConfigCallback``) is in the fit: rank 0 saves
``OUT_DIR/config.yaml`` in the first fit; the restarted worker must not save or broadcast again.
``zero``: ``kill`` of slot 0 (global rank 0) with ``zero_stage=2`` and Adam instead of SGD with
momentum.
``kill``/``user``/``zero`` scale the learning rate (0.05) by the world size (``scale_lr_by_world_size``);
the first batch of every fit prints the rate; every training step prints a ``torch.rand`` draw.
Every training step records ``(epoch, world size, global step, the indices all ranks trained)``
in the module, which is committed with the checkpoints, so a recovered fit keeps only the
committed steps' records. Each slot that finishes saves its final weights and the records to
``OUT_DIR/final.<slot>.pt``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_trainer.strategy import HorovodStrategy

OUT_DIR, MODE = Path(sys.argv[1]), sys.argv[2]
SLOT = int(os.environ["RANK"])  # the launch rank; the world's rank may differ after a recovery
RESPAWN = int(os.environ.get("HVDRUN_RESPAWN_COUNT", "0"))
N, BATCH, EPOCHS, COMMIT_EVERY, KILL_STEP = 64, 4, 4, 2, 5
KILL_SLOT = 0 if MODE == "zero" else 1
STEP_SLEEP = {1: 0.5, 2: 0.1}  # seconds per step by world size: slow alone, so the restarted worker
# joins before the fit ends; and alone, the survivor first waits (event: the restarted worker's
# ``fit.<slot>`` file, written just before its fit) for the new Python to have imported torch and
# Lightning, which under a loaded CI host can take longer than the steps left
JOINER_WAIT_S = 120.0


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.seen: list[tuple[int, int, int, list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if MODE == "user" and self.global_rank == 1 and self.global_step == 2:
            raise ValueError(f"bad batch {self.global_step}")
        x, y, idx = batch
        draw = torch.rand(1).item()  # a redone step must draw what it drew the first time
        print(f"DRAW slot={SLOT} step={self.global_step} size={self.trainer.world_size} value={draw:.8f}",
              flush=True)
        if self.trainer.world_size == 1 and MODE != "user":
            _await_joiner()
        time.sleep(STEP_SLEEP.get(self.trainer.world_size, 0.1))
        indices = sorted(self.all_gather(idx).flatten().tolist())
        self.seen.append((self.current_epoch, self.trainer.world_size, self.global_step, indices))
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        if MODE == "zero":
            return torch.optim.Adam(self.parameters(), lr=0.05)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["seen"] = list(self.seen)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.seen = list(checkpoint["seen"])


class Report(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        print(f"START slot={SLOT} pid={os.getpid()} rank={trainer.global_rank} size={trainer.world_size} "
              f"respawn={RESPAWN} step={trainer.global_step}", flush=True)
        self.said_lr = False

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self.said_lr:  # the first batch of each fit (the strategy's on_train_start ran)
            self.said_lr = True
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            print(f"LR slot={SLOT} size={trainer.world_size} lr={lr:.4f}", flush=True)
        if MODE in ("kill", "cli", "zero") and RESPAWN == 0 and SLOT == KILL_SLOT \
                and trainer.global_step == KILL_STEP:
            print(f"FAIL_AT {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def _await_joiner() -> None:
    """Alone: wait until the lost slot's new process is about to call ``fit``."""
    marker, deadline = OUT_DIR / f"fit.{KILL_SLOT}", time.monotonic() + JOINER_WAIT_S
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _announce_fit() -> None:
    print(f"FIT slot={SLOT} pid={os.getpid()} respawn={RESPAWN}", flush=True)
    if RESPAWN > 0:
        (OUT_DIR / f"fit.{SLOT}").write_text(str(os.getpid()))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g), torch.arange(N))


class Data(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=BATCH, shuffle=True)


def _cli() -> tuple[pl.Trainer, pl.LightningModule, pl.LightningDataModule]:
    from pytorch_lightning.cli import LightningCLI

    strategy = ('{"class_path": "hvd_trainer.strategy.HorovodStrategy", "init_args": '
                f'{{"elastic_commit_every_n_steps": {COMMIT_EVERY}}}}}')
    cli = LightningCLI(Regressor, Data, run=False, args=[
        f"--trainer.strategy={strategy}", "--trainer.accelerator=cpu", "--trainer.devices=2",
        f"--trainer.max_epochs={EPOCHS}", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={OUT_DIR}"])
    cli.trainer.callbacks.append(Report())
    return cli.trainer, cli.model, cli.datamodule


def main() -> None:
    if MODE == "cli":
        trainer, model, data = _cli()
        _announce_fit()
        trainer.fit(model, datamodule=data)
        _finish(trainer, model)
        return
    data = _data()
    trainer = pl.Trainer(
        strategy=HorovodStrategy(elastic_commit_every_n_steps=COMMIT_EVERY, scale_lr_by_world_size=True,
                                 zero_stage=2 if MODE == "zero" else 0),
        accelerator="cpu",
        devices=2, max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Report()],
    )
    model = Regressor()
    _announce_fit()
    trainer.fit(model, DataLoader(data, batch_size=BATCH, shuffle=True))
    _finish(trainer, model)


def _finish(trainer: pl.Trainer, model: Regressor) -> None:
    torch.save({"model": model.state_dict(), "seen": model.seen, "step": trainer.global_step},
               OUT_DIR / f"final.{SLOT}.pt")
    print(f"DONE slot={SLOT} pid={os.getpid()} rank={trainer.global_rank} size={trainer.world_size} "
          f"step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()

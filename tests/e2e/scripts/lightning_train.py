"""A user's Lightning script: ``Trainer(strategy="horovod", devices=2)``.

``python lightning_train.py`` starts the second process itself; under ``hvdrun -np 2`` it uses
the launcher's processes. Each rank prints ``RANK <rank>/<world> pid=<pid> checksum=<sum>``.

``--explicit-env`` passes ``plugins=[HorovodEnvironment()]``, which skips Lightning's own
cluster detection (needed where mpi4py is installed without an MPI library).
``--kill-rank1`` / ``--kill-rank0`` make that rank SIGKILL itself at its third step (printing
``KILLED pid=<pid> at=<time>``): the surviving rank must fail fast with an error naming what died.
``--busy-survivor`` keeps the other rank computing (5 s) at that step, so the launcher's SIGTERM
reaches it outside any collective (as in a large model's forward pass).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hvd_trainer  # noqa: F401  (registers strategy="horovod")
from hvd_trainer.lightning.cluster_env import HorovodEnvironment


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        victim = 1 if "--kill-rank1" in sys.argv else 0 if "--kill-rank0" in sys.argv else None
        if self.global_rank == victim and batch_idx == 2:
            # let the survivor finish step 1's last bucket and enter its compute first: a kill
            # while gloo still delivers that bucket is the other scenario (a collective in flight)
            if "--busy-survivor" in sys.argv:
                time.sleep(1.0)
            print(f"KILLED pid={os.getpid()} at={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        busy = "--busy-survivor" in sys.argv
        if busy and victim is not None and self.global_rank != victim and batch_idx == 2:
            time.sleep(5.0)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    torch.manual_seed(int(os.environ.get("LOCAL_RANK", "0")))  # ranks differ until broadcast
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, generator=g), torch.randn(64, 1, generator=g))
    plugins = [HorovodEnvironment()] if "--explicit-env" in sys.argv else None
    trainer = pl.Trainer(
        strategy="horovod", accelerator="cpu", devices=2, max_steps=4, plugins=plugins,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor()
    trainer.fit(model, DataLoader(data, batch_size=8))
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"RANK {trainer.global_rank}/{trainer.world_size} pid={os.getpid()} "
          f"checksum={checksum:.12f}", flush=True)


if __name__ == "__main__":
    main()

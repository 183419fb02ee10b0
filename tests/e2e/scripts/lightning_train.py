"""A user's Lightning script: ``Trainer(strategy="horovod", devices=2)``.

``python lightning_train.py`` starts the second process itself; under ``hvdrun -np 2`` it uses
the launcher's processes. Each rank prints ``RANK <rank>/<world> pid=<pid> checksum=<sum>``.

``--explicit-env`` passes ``plugins=[HorovodEnvironment()]``, which skips Lightning's own
cluster detection (needed where mpi4py is installed without an MPI library).
``--kill-rank1`` / ``--kill-rank0`` make that rank SIGKILL itself at its third step (printing
``KILLED pid=<pid> at=<time>``): the surviving rank must fail fast with an error naming what died.
``--busy-survivor MARKER`` keeps the other rank computing (5 s) at that step, so the launcher's
SIGTERM reaches it outside any collective (as in a large model's forward pass): the survivor
creates the file MARKER as it starts computing, and the victim waits for it before the kill.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hvd_trainer  # noqa: F401  (registers strategy="horovod")
from hvd_trainer.lightning.cluster_env import HorovodEnvironment


def busy_marker() -> Path | None:
    """The file given after ``--busy-survivor`` (the survivor computes at the kill), else None."""
    if "--busy-survivor" not in sys.argv:
        return None
    return Path(sys.argv[sys.argv.index("--busy-survivor") + 1])


def await_file(path: Path, timeout: float = 60.0) -> None:
    """Return once ``path`` exists (another rank's signal); TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        victim = 1 if "--kill-rank1" in sys.argv else 0 if "--kill-rank0" in sys.argv else None
        marker = busy_marker()
        if self.global_rank == victim and batch_idx == 2:
            # let the survivor finish step 1's last bucket and enter its compute first: a kill
            # while gloo still delivers that bucket is the other scenario (a collective in flight)
            if marker is not None:
                await_file(marker)
            print(f"KILLED pid={os.getpid()} at={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if marker is not None and victim is not None and self.global_rank != victim and batch_idx == 2:
            marker.touch()  # computing now (step 1's collectives are done): the victim may die
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

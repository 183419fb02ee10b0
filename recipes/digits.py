"""Train a small CNN on handwritten digits with ``Trainer(strategy="horovod")``.

The data is scikit-learn's bundled copy of the UCI optical digits (1,797 grey 8x8 images, ten
classes), so nothing is downloaded. A fixed, seeded 80/20 split gives 1,437 training and 360
validation images; every rank reads its own shard of both through Lightning's DistributedSampler.

Launch (settings: dataclass defaults < conf/digits.yaml < command line):

    # one node, 2 CPU processes (what `make demo` runs)
    hvdrun -np 2 hvd-train recipe=digits
    # one node, 4 GPUs, bf16 autocast, more epochs
    hvdrun -np 4 hvd-train recipe=digits trainer.precision=bf16-mixed trainer.max_epochs=30
    # a single process, for comparison
    hvd-train recipe=digits

Rank 0 prints the derived quantities first and a final ``RESULT`` line (printed by hvd-train).
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import hvd_trainer  # noqa: F401  (registers strategy="horovod")

# Config: the schema, in its own module (hvd-train reads it without importing torch or Lightning).
# conf/digits.yaml and the command line can only override its fields.
from ._digits_config import Config, DataConfig, ModelConfig, OptimConfig, TrainerConfig
from ._strategy import build_strategy

__all__ = [
    "Config", "DataConfig", "ModelConfig", "OptimConfig", "TrainerConfig",
    "DigitsCNN", "DigitsData", "run",
]


# ------------------------------------------------------------------------------------------------
# Data: 8x8 images with pixel values 0..16, scaled to [0, 1].
class DigitsData(pl.LightningDataModule):
    def __init__(self, cfg: DataConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [1797, 1, 8, 8]
        y = torch.tensor(digits.target, dtype=torch.int64)  # [1797]
        # The split depends only on split_seed, never on the rank or world size.
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.cfg.split_seed))
        n_val = round(len(y) * self.cfg.val_fraction)
        val_idx, train_idx = order[:n_val], order[n_val:]
        self.train_set = TensorDataset(x[train_idx], y[train_idx])
        self.val_set = TensorDataset(x[val_idx], y[val_idx])

    def train_dataloader(self) -> DataLoader:
        # shuffle=True: Lightning turns it into a DistributedSampler(shuffle=True) per rank.
        return DataLoader(self.train_set, batch_size=self.cfg.batch_size_per_rank, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


# ------------------------------------------------------------------------------------------------
# Model: two 3x3 convs, one pooling step, two linear layers (~150k parameters at the defaults).
class DigitsCNN(pl.LightningModule):
    def __init__(self, model: ModelConfig, optim: OptimConfig) -> None:
        super().__init__()
        self.optim_cfg = optim
        c = model.channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(model.dropout),
            nn.Linear(2 * c * 4 * 4, model.hidden), nn.ReLU(),
            nn.Linear(model.hidden, 10),
        )
        # Counts correct predictions and samples; its state is summed over ranks at compute(),
        # so the accuracy covers the whole validation set and is the same on every rank.
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_acc.update(self(x), y)
        self.log("val_acc", self.val_acc, on_step=False, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        o = self.optim_cfg
        return torch.optim.SGD(
            self.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay
        )


class _Throughput(pl.Callback):
    """Training samples per second over the whole fit (all ranks), excluding validation."""

    def __init__(self) -> None:
        self.samples = 0
        self.seconds = 0.0
        self._start = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.samples += batch[0].shape[0] * trainer.world_size

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds += time.perf_counter() - self._start


def _quiet_known_warnings() -> None:
    # Lightning 2.6 calls a torch pytree API that newer torch deprecates; harmless, once per rank.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")


def _set_threads(cfg: TrainerConfig) -> None:
    """One process per core share: oversubscribed intra-op threads make every rank slower."""
    threads = cfg.threads_per_process
    if threads == 0:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------
def run(cfg: Config) -> dict[str, float]:
    """Train and validate; return world_size, val_acc, epochs, samples_per_s, wall_s."""
    t0 = time.perf_counter()
    _quiet_known_warnings()
    _set_threads(cfg.trainer)
    pl.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    model = DigitsCNN(cfg.model, cfg.optim)
    data = DigitsData(cfg.data)
    throughput = _Throughput()
    with tempfile.TemporaryDirectory(prefix="hvd_digits_") as tmp:
        trainer = pl.Trainer(
            strategy=build_strategy(cfg.trainer),
            accelerator=cfg.trainer.accelerator,
            precision=cfg.trainer.precision,
            max_epochs=cfg.trainer.max_epochs,
            callbacks=[throughput],
            default_root_dir=tmp,  # nothing is kept: no logger, no checkpoints
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        world = trainer.world_size
        if trainer.is_global_zero:
            print(
                f"digits: world_size={world} batch_size_per_rank={cfg.data.batch_size_per_rank} "
                f"global_batch_size={cfg.data.batch_size_per_rank * world} lr={cfg.optim.lr} "
                f"epochs={cfg.trainer.max_epochs} threads_per_process={torch.get_num_threads()}",
                flush=True,
            )
        trainer.fit(model, datamodule=data)
    val_acc = float(trainer.callback_metrics["val_acc"])
    return {
        "world_size": world,
        "val_acc": val_acc,
        "epochs": trainer.current_epoch,
        "samples_per_s": throughput.samples / max(throughput.seconds, 1e-9),
        "wall_s": time.perf_counter() - t0,
    }

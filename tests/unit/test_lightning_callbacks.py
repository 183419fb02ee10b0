"""Lightning warmup/schedule callbacks on a single-process Trainer: LR per batch vs closed form."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.environments import LightningEnvironment
from torch.utils.data import DataLoader, TensorDataset

from hvd_trainer.lightning.callbacks import LearningRateSchedule, LearningRateWarmup

STEPS = 4


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.seen: list[tuple[int, int, list[float]]] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.seen.append((self.current_epoch, batch_idx, [g["lr"] for g in opt.param_groups]))
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        # two groups with different LRs: each ramps to its own target
        return torch.optim.SGD([{"params": [self.layer.weight], "lr": 0.4},
                                {"params": [self.layer.bias], "lr": 0.2}])

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(STEPS * 2, 3, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)


def _fit(callback, epochs):
    model = Tiny()
    trainer = pl.Trainer(max_epochs=epochs, callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                         # explicit: MPI detection needs libmpi, which this machine lacks
                         plugins=[LightningEnvironment()])
    trainer.fit(model)
    return model.seen


@pytest.mark.parametrize("warmup", [2, 1.5])
def test_warmup_per_batch_and_group(warmup):
    seen = _fit(LearningRateWarmup(warmup_epochs=warmup, size=4), epochs=3)
    assert len(seen) == 3 * STEPS
    for epoch, batch, lrs in seen:
        t = epoch + batch / STEPS
        for lr, target in zip(lrs, (0.4, 0.2), strict=True):
            expected = target if t >= warmup else target / 4 * (t * 3 / warmup + 1)
            assert lr == pytest.approx(expected, rel=1e-12)


def test_schedule_function_staircase_false():
    seen = _fit(LearningRateSchedule(0.3, multiplier=lambda e: 0.5**e, staircase=False), epochs=2)
    for epoch, batch, lrs in seen:
        assert lrs == [pytest.approx(0.3 * 0.5 ** (epoch + batch / STEPS))] * 2

"""Lightning callbacks on the shared schedule maths of :mod:`hvd_trainer.callbacks`.

``Trainer(strategy="horovod", callbacks=[LearningRateWarmup(warmup_epochs=3)])`` ramps every
optimizer parameter group from ``lr / size`` to its ``lr`` per batch, as
``hvd_trainer.keras.callbacks.LearningRateWarmupCallback`` does for Keras. Metric averaging is
not needed here: ``self.log(..., sync_dist=True)`` reduces through the strategy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl

from hvd_trainer.callbacks.schedules import LRSchedule, LRWarmup, ScheduleError, fractional_epoch

__all__ = ["LearningRateWarmup", "LearningRateSchedule"]


def _steps(trainer: pl.Trainer, explicit: int | None) -> int:
    steps = explicit if explicit is not None else trainer.num_training_batches
    if not steps or (isinstance(steps, float) and math.isinf(steps)):
        raise ScheduleError(
            f"the number of training batches per epoch is unknown ({steps!r}). HINT: pass "
            "steps_per_epoch= to the callback (e.g. for an IterableDataset)."
        )
    return int(steps)


def _groups(trainer: pl.Trainer):
    for opt in trainer.optimizers:
        yield from opt.param_groups


class LearningRateWarmup(pl.Callback):
    """Per-batch linear warmup from ``target / size`` to ``target`` (Goyal et al. 2017,
    arXiv:1706.02677) over ``warmup_epochs``, for every parameter group of every optimizer.

    ``target`` is ``initial_lr`` if given, else each group's ``lr`` when training starts. It is
    saved in the callback's state, so a resumed run continues the same ramp. After the warmup the
    LR is set to ``target`` once and then left to the user's schedulers. Progress counts
    training batches (``epoch + batch_idx / steps_per_epoch``).

    Example:
        >>> trainer = Trainer(strategy="horovod", callbacks=[LearningRateWarmup(warmup_epochs=3)])

    Args:
        warmup_epochs: ramp length, epochs (> 0).
        initial_lr: the LR after warmup for all groups (default: each group's own ``lr``).
        size: the factor of the ramp (default: ``trainer.world_size``).
        steps_per_epoch: batches per epoch (default: ``trainer.num_training_batches``).

    Raises:
        ScheduleError: invalid values, or the number of batches per epoch is unknown.
    """

    def __init__(self, warmup_epochs: float = 5.0, initial_lr: float | None = None,
                 size: int | None = None, steps_per_epoch: int | None = None) -> None:
        LRWarmup(initial_lr=initial_lr or 1.0, warmup_epochs=warmup_epochs, size=size or 1)
        self.warmup_epochs = warmup_epochs
        self.initial_lr = initial_lr
        self.size = size
        self.steps_per_epoch = steps_per_epoch
        self.targets: list[float] | None = None
        self._ramps: list[LRWarmup] = []
        self._steps = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        groups = list(_groups(trainer))
        if self.targets is None or len(self.targets) != len(groups):
            self.targets = [float(self.initial_lr or g["lr"]) for g in groups]
        size = self.size or trainer.world_size
        self._ramps = [LRWarmup(initial_lr=t, warmup_epochs=self.warmup_epochs, size=size)
                       for t in self.targets]
        self._steps = _steps(trainer, self.steps_per_epoch)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        t = fractional_epoch(trainer.current_epoch, batch_idx, self._steps)
        if not self._ramps or t - 1 / self._steps >= self.warmup_epochs:
            return  # after the warmup (the first batch past it sets the target exactly)
        for group, ramp in zip(_groups(trainer), self._ramps, strict=True):
            group["lr"] = ramp.lr_at(t)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.targets is not None and trainer.current_epoch + 1 == self.warmup_epochs:
            for group, target in zip(_groups(trainer), self.targets, strict=True):
                group["lr"] = target

    def state_dict(self) -> dict[str, Any]:
        return {"targets": self.targets}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.targets = state_dict.get("targets")


class LearningRateSchedule(pl.Callback):
    """``lr = initial_lr * factor(epoch)`` for every group while ``start_epoch <= epoch < end_epoch``
    (the maths of :class:`hvd_trainer.callbacks.LRSchedule`: a float multiplier compounds per
    epoch, a function gives the factor; closed form, so resuming is exact).

    Args:
        initial_lr: the LR the factor multiplies.
        multiplier: float ``m`` (factor ``m ** (epoch - start_epoch)``, 1 at ``start_epoch``) or ``f(epoch)``.
        start_epoch, end_epoch: the epochs this callback owns.
        staircase: function multiplier evaluated once per epoch (True) or per batch (False).
        steps_per_epoch: batches per epoch for ``staircase=False`` (default from the trainer).

    Raises:
        ScheduleError: invalid values.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        self.schedule = LRSchedule(initial_lr=initial_lr, multiplier=multiplier,
                                   start_epoch=start_epoch, end_epoch=end_epoch, staircase=staircase)
        self.steps_per_epoch = steps_per_epoch
        self._steps: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.schedule.staircase:
            self._steps = _steps(trainer, self.steps_per_epoch)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        lr = self.schedule.lr_at(trainer.current_epoch, batch_idx, self._steps)
        if lr is not None:
            for group in _groups(trainer):
                group["lr"] = lr

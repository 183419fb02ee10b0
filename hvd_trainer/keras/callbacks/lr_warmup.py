"""Per-batch learning-rate warmup from ``initial_lr / size`` to ``initial_lr``."""

from __future__ import annotations

import keras

from hvd_trainer.callbacks.schedules import LRWarmup, fractional_epoch
from hvd_trainer.comm import get_world
from hvd_trainer.keras.callbacks._lr import get_lr, set_lr, steps_per_epoch

__all__ = ["LearningRateWarmupCallback"]


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate linearly, every batch, over the first ``warmup_epochs`` epochs.

    ``lr = initial_lr / size * (t * (size - 1) / warmup_epochs + 1)`` at fractional epoch
    ``t = epoch + batch / steps_per_epoch`` (Goyal et al. 2017, arXiv:1706.02677); at the end of
    epoch ``warmup_epochs - 1`` the LR is set to ``initial_lr`` and then left alone (a later
    scheduler or ``ReduceLROnPlateau`` owns it). Resuming with ``initial_epoch`` gives the same
    values: the LR is a closed form of the epoch. ``logs["learning_rate"]`` is added at epoch end.

    Example:
        >>> LearningRateWarmupCallback(initial_lr=0.1 * hvd_trainer.size(), warmup_epochs=3)

    Args:
        initial_lr: the LR after warmup (usually the single-process LR times the world size).
        warmup_epochs: length of the ramp, epochs.
        momentum_correction: accepted for Horovod's signature (same position); no effect, see
            :class:`LearningRateScheduleCallback`.
        steps_per_epoch: batches per epoch; default: what ``fit`` reports.
        verbose: 1 prints one line on rank 0 when the warmup ends.

    Raises:
        ScheduleError: non-positive ``initial_lr``/``warmup_epochs``.
        LearningRateCallbackError: the number of steps per epoch is unknown.
    """

    def __init__(self, initial_lr: float, warmup_epochs: float = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        super().__init__()
        self.momentum_correction = bool(momentum_correction)
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        LRWarmup(initial_lr=self.initial_lr, warmup_epochs=warmup_epochs, size=1)  # validate now
        self._warmup: LRWarmup | None = None
        self._epoch = 0

    def on_train_begin(self, logs=None) -> None:
        self._warmup = LRWarmup(initial_lr=self.initial_lr, warmup_epochs=self.warmup_epochs,
                                size=get_world().size)
        self._steps = steps_per_epoch(self.steps_per_epoch, self.params)

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None) -> None:
        if self._warmup is None:
            return
        t = fractional_epoch(self._epoch, batch, self._steps)
        if self._warmup.in_warmup(t):
            set_lr(self.model.optimizer, self._warmup.lr_at(t))
        elif t - 1 / self._steps < self.warmup_epochs:  # first batch after a fractional warmup
            set_lr(self.model.optimizer, self.initial_lr)

    def on_epoch_end(self, epoch, logs=None) -> None:
        if self._warmup is not None and epoch + 1 == self._warmup.warmup_epochs:
            set_lr(self.model.optimizer, self.initial_lr)
            if self.verbose and get_world().rank == 0:
                print(f"\nEpoch {epoch + 1}: finished learning-rate warmup to {self.initial_lr:g}.")
        if logs is not None:
            logs["learning_rate"] = get_lr(self.model.optimizer)

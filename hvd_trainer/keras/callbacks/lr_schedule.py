"""Multiply the learning rate by a constant per epoch, or by a function of the epoch."""

from __future__ import annotations

from collections.abc import Callable

import keras

from hvd_trainer.callbacks.schedules import LRSchedule
from hvd_trainer.keras.callbacks._lr import get_lr, set_lr, steps_per_epoch

__all__ = ["LearningRateScheduleCallback"]


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set ``lr = initial_lr * factor(epoch)`` while ``start_epoch <= epoch < end_epoch``.

    A float ``multiplier`` ``m`` is compounded once per epoch from ``start_epoch`` on
    (``factor = m ** (epoch - start_epoch + 1)``, changed on the first batch of each epoch); a
    function ``multiplier(epoch)`` gives the factor directly, evaluated on the first batch of
    each epoch (``staircase=True``) or on every batch at the fractional epoch. The value is a
    closed form of the epoch, so it is right after resuming with ``fit(initial_epoch=...)``.
    Outside the range the LR is left alone. ``logs["learning_rate"]`` is added at epoch end.

    Example:
        >>> LearningRateScheduleCallback(initial_lr=0.4, multiplier=0.1, start_epoch=30, end_epoch=60)

    Args:
        initial_lr: the LR the factor multiplies.
        multiplier: float ``m`` or ``f(epoch) -> factor``.
        start_epoch, end_epoch: the epochs ``[start_epoch, end_epoch)`` the callback owns.
        staircase: for a function multiplier: once per epoch (True) or every batch (False).
        steps_per_epoch: batches per epoch (only for ``staircase=False``); default from ``fit``.

    Raises:
        ScheduleError: invalid arguments (non-positive values, ``end_epoch <= start_epoch``).
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__()
        self.schedule = LRSchedule(initial_lr=float(initial_lr), multiplier=multiplier,
                                   start_epoch=start_epoch, end_epoch=end_epoch, staircase=staircase)
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0
        self._steps: int | None = None

    def on_train_begin(self, logs=None) -> None:
        if not self.schedule.staircase:
            self._steps = steps_per_epoch(self.steps_per_epoch, self.params)

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None) -> None:
        lr = self.schedule.lr_at(self._epoch, batch, self._steps)
        if lr is not None:
            set_lr(self.model.optimizer, lr)

    def on_epoch_end(self, epoch, logs=None) -> None:
        if logs is not None:
            logs["learning_rate"] = get_lr(self.model.optimizer)

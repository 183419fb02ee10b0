"""Multiply the learning rate by a constant per epoch, or by a function of the epoch."""

from __future__ import annotations

from collections.abc import Callable

import keras

from hvd_trainer.callbacks.schedules import LRSchedule
from hvd_trainer.keras.callbacks._lr import get_lr, set_lr, steps_per_epoch

__all__ = ["LearningRateScheduleCallback"]


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set ``lr = initial_lr * factor(epoch)`` while ``start_epoch <= epoch < end_epoch``
    (Horovod's ``LearningRateScheduleCallback``; the maths is :class:`~hvd_trainer.callbacks.LRSchedule`).

    A float ``multiplier`` ``m`` is Horovod's exponential decay ``factor = m ** (epoch -
    start_epoch)``: factor 1 in ``start_epoch``, ``m`` in the next epoch, and so on. A function
    ``multiplier(epoch)`` gives the factor directly. With ``staircase=True`` (default) the LR is
    set on the first batch of each epoch from the integer epoch; with ``staircase=False`` on
    every batch from the fractional epoch ``epoch + batch / steps_per_epoch`` (a float ``m``
    then decays smoothly). The value is a closed form of the epoch, so it is right after
    resuming with ``fit(initial_epoch=...)``. Outside the range the LR is left alone (after
    ``end_epoch`` it keeps the value of epoch ``end_epoch - 1``). ``logs["learning_rate"]`` is
    added at epoch end.

    Not copied from Horovod: ``momentum_correction`` (scaling SGD's momentum by ``new_lr /
    old_lr`` for the batch where the LR changed). A Keras 3 optimizer's ``momentum`` is a Python
    float that a compiled train step (TensorFlow backend) has already baked in, so changing it
    would act on one backend only; the argument is accepted and has no effect.

    Example:
        >>> LearningRateScheduleCallback(initial_lr=0.4, multiplier=0.1, start_epoch=30, end_epoch=60)

    Args:
        initial_lr: the LR the factor multiplies.
        multiplier: float ``m`` or ``f(epoch) -> factor``.
        start_epoch, end_epoch: the epochs ``[start_epoch, end_epoch)`` the callback owns.
        staircase: once per epoch (True) or every batch at the fractional epoch (False).
        momentum_correction: accepted for Horovod's signature; no effect (see above).
        steps_per_epoch: batches per epoch (only for ``staircase=False``); default from ``fit``.

    Raises:
        ScheduleError: invalid arguments (non-positive values, ``end_epoch <= start_epoch``).
        LearningRateCallbackError: ``staircase=False`` and the steps per epoch are unknown.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        self.schedule = LRSchedule(initial_lr=float(initial_lr), multiplier=multiplier,
                                   start_epoch=start_epoch, end_epoch=end_epoch, staircase=staircase)
        self.momentum_correction = bool(momentum_correction)
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

"""Reading and writing a Keras 3 optimizer's learning rate (there is no ``optimizer.lr``)."""

from __future__ import annotations

import keras

__all__ = ["LearningRateCallbackError", "get_lr", "set_lr", "steps_per_epoch"]


class LearningRateCallbackError(ValueError):
    """A learning-rate callback cannot run with this model/fit setup."""


def get_lr(optimizer) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def set_lr(optimizer, value: float) -> None:
    try:
        optimizer.learning_rate = float(value)
    except TypeError as exc:
        raise LearningRateCallbackError(
            f"cannot set the learning rate of {optimizer.name!r}: it was built with a "
            f"LearningRateSchedule ({exc}). HINT: give the optimizer a float learning_rate."
        ) from exc


def steps_per_epoch(explicit: int | None, params: dict) -> int:
    steps = explicit if explicit is not None else params.get("steps")
    if not steps:
        raise LearningRateCallbackError(
            f"steps_per_epoch is unknown (callback got {explicit!r}, fit reported "
            f"steps={params.get('steps')!r}). HINT: pass steps_per_epoch= to the callback."
        )
    return int(steps)

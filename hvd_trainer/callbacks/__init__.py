"""Framework-neutral callback maths: LR warmup/schedule formulas and metric averaging.

No Keras or Lightning imports here; ``hvd_trainer.keras.callbacks`` and
``hvd_trainer.lightning.callbacks`` adapt these to their frameworks.
"""

from __future__ import annotations

from hvd_trainer.callbacks.metrics import MetricKeysMismatchError, average_metrics
from hvd_trainer.callbacks.schedules import LRSchedule, LRWarmup, ScheduleError, fractional_epoch

__all__ = [
    "LRWarmup", "LRSchedule", "ScheduleError", "fractional_epoch",
    "average_metrics", "MetricKeysMismatchError",
]

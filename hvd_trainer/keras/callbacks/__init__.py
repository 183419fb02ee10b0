"""Keras 3 callbacks with the names of ``horovod.tensorflow.keras.callbacks``."""

from __future__ import annotations

from hvd_trainer.keras.callbacks._lr import LearningRateCallbackError
from hvd_trainer.keras.callbacks.broadcast import BroadcastGlobalVariablesCallback, broadcast_variables
from hvd_trainer.keras.callbacks.checkpoint import BestModelCheckpoint
from hvd_trainer.keras.callbacks.local_sgd import LocalSGDCallback
from hvd_trainer.keras.callbacks.lr_schedule import LearningRateScheduleCallback
from hvd_trainer.keras.callbacks.lr_warmup import LearningRateWarmupCallback
from hvd_trainer.keras.callbacks.metric_average import MetricAverageCallback

__all__ = [
    "BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
    "LearningRateScheduleCallback", "BestModelCheckpoint", "broadcast_variables",
    "LearningRateCallbackError", "LocalSGDCallback",
]

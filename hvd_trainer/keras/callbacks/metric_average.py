"""Average epoch metrics over ranks before later callbacks read them."""

from __future__ import annotations

import keras

from hvd_trainer.callbacks.metrics import average_metrics

__all__ = ["MetricAverageCallback"]


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace every numeric entry of the epoch ``logs`` (``loss``, ``val_*``, ...) with its
    average over ranks, in place.

    Keras passes one ``logs`` dict to the callbacks in list order (History and the progress
    bar come last), so list this callback *before* ``EarlyStopping``, ``ReduceLROnPlateau``
    or ``ModelCheckpoint``: they then decide the same on every rank. It issues a collective,
    so it is never ``async_safe``.

    Example:
        >>> callbacks = [MetricAverageCallback(), keras.callbacks.EarlyStopping(patience=3)]

    Raises:
        MetricKeysMismatchError: ranks logged different metric names.
    """

    def on_epoch_end(self, epoch, logs=None) -> None:
        if logs is None:
            return
        logs.update(average_metrics(logs))

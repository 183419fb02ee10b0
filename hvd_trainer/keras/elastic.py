"""Elastic Keras training with Horovod's names (``horovod.tensorflow.keras.elastic``).

``KerasState`` and ``run`` are :class:`hvd_trainer.elastic.KerasState` and
:func:`hvd_trainer.elastic.run`; the three callbacks keep ``state`` current during ``fit`` so
that a restart resumes from the last commit::

    import hvd_trainer.keras as hvd
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, initial_epoch=state.epoch, epochs=epochs, callbacks=[
            hvd.elastic.UpdateEpochStateCallback(state),
            hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.CommitStateCallback(state, batches_per_commit=10)])

    train(state)
"""

from __future__ import annotations

from typing import Any

import keras

from hvd_trainer.elastic.keras_state import KerasState
from hvd_trainer.elastic.run import run

__all__ = ["KerasState", "run", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback"]


class CommitStateCallback(keras.callbacks.Callback):
    """``state.commit()`` after every ``batches_per_commit`` training batches and at each epoch end.

    The batch count restarts at ``on_train_begin``, so every rank commits at the same batches
    after a restart too.

    Args:
        state: the elastic state (e.g. :class:`KerasState`).
        batches_per_commit: batches between commits (>= 1).

    Raises:
        ValueError: ``batches_per_commit`` is not an int >= 1.
    """

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) \
                or batches_per_commit < 1:
            raise ValueError(
                f"batches_per_commit={batches_per_commit!r} must be an int >= 1. HINT: "
                "batches_per_commit=1 commits after every batch."
            )
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the last finished batch of the epoch (0 again at epoch end).

    After a restart in the middle of an epoch, the first epoch's ``params["steps"]`` (what
    Keras' progress bar and callbacks read) is shortened by ``state.batch``, as Horovod does;
    the data pipeline itself must skip the batches already seen (e.g. with
    :class:`hvd_trainer.elastic.ElasticSampler` or ``fit(steps_per_epoch=...)``).

    Args:
        state: the elastic state; needs a ``batch`` attribute (``KerasState(model, batch=0)``).
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs=None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None) -> None:
        steps = self.params.get("steps")
        if steps:
            if self.steps_per_epoch is None:
                self.steps_per_epoch = steps
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Set ``state.epoch`` to the number of finished epochs, counted across restarts.

    At each epoch end ``state.epoch = initial + epoch + 1``, where ``initial`` is
    ``state.epoch`` when ``fit`` began and ``epoch`` is Keras' epoch index. As in Horovod's
    examples, resume with ``fit(epochs=total - state.epoch)`` (no ``initial_epoch``: Keras'
    index would then already include it and be counted twice).

    Args:
        state: the elastic state; needs an ``epoch`` attribute.
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1

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

In-process recovery (``hvdrun --min-np/--max-np --recovery in-process``, as Horovod's elastic
Keras did it): a rank lost inside ``fit`` makes the allreduce fail on the others; the failure
leaves ``fit`` (on TensorFlow as the ``UnknownError`` of the allreduce's ``tf.numpy_function``,
which :func:`~hvd_trainer.elastic.user_error.is_peer_failure` still counts as the peer's
failure) and ``run`` re-forms the world in the surviving processes, restores the state from its
last commit in memory, runs the reset callbacks and calls ``train`` again. The restarted worker
joins at the survivors' next commit: ``CommitStateCallback``'s ``state.commit()`` raises
``HostsUpdatedInterrupt``, which leaves ``fit`` the same way (Keras runs these callbacks in the
training loop's thread), and the joiner receives the weights and optimizer state by broadcast.
The ``DistributedOptimizer`` (built without ``world=``), ``MetricAverageCallback`` and
``BroadcastGlobalVariablesCallback`` use the world current at each step; what was computed from
the world size must be recomputed in a reset callback, e.g. the learning rate::

    def on_state_reset():
        model.optimizer.learning_rate = lr * hvd.size()

    state.register_reset_callbacks([on_state_reset])

``train`` resumes at ``state.batch`` (see :class:`UpdateBatchStateCallback` for the data).
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
    """Keep ``state.batch`` at the index of the last finished batch of the epoch (0 again at epoch
    end), counted from the epoch's start also when ``fit`` resumed in its middle.

    As in Horovod, a resumed epoch starts at ``state.batch``: after a restart or an in-process
    recovery in the middle of an epoch, that batch (the last one committed) is trained again and
    none is skipped. The index of a ``fit`` that begins with ``state.batch = b`` starts at ``b``
    in its first epoch (Horovod counts from 0 there, so a second failure in that epoch resumed at
    the wrong batch), and that epoch's ``params["steps"]`` (what Keras' progress bar and
    callbacks read) is shortened by ``b``, as Horovod does. The data pipeline itself must start
    at batch ``b``: Keras 3 runs every epoch of one ``fit`` for the same number of steps, so
    resume with one ``fit(<batches b..steps-1>, epochs=1)`` for the rest of the epoch, then the
    remaining epochs::

        @hvd.elastic.run
        def train(state):
            if state.batch:
                model.fit(batches(state.batch, steps), epochs=1, callbacks=callbacks)
            model.fit(batches(0, steps), epochs=epochs - state.epoch, callbacks=callbacks)

    Args:
        state: the elastic state; needs a ``batch`` attribute (``KerasState(model, batch=0)``).
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None
        self.offset = 0
        """What Keras' batch index 0 is in the epoch: ``state.batch`` when ``fit`` began, until
        its first epoch ends."""

    def on_train_begin(self, logs=None) -> None:
        self.steps_per_epoch = None
        self.offset = self.state.batch

    def on_epoch_begin(self, epoch, logs=None) -> None:
        steps = self.params.get("steps")
        if steps:
            if self.steps_per_epoch is None:
                self.steps_per_epoch = steps
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.state.batch = self.offset + batch

    def on_epoch_end(self, epoch, logs=None) -> None:
        self.state.batch = 0
        self.offset = 0


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

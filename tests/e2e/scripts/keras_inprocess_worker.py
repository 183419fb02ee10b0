"""In-process recovery worker, Keras 3 (``KERAS_BACKEND`` torch or tensorflow), written like Horovod's
``examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py``.

Usage: keras_inprocess_worker.py OUT_DIR KILL_AT [ZERO_STAGE]
``@hvd.elastic.run def train(state): model.fit(...)`` with ``MetricAverageCallback`` and the three
elastic callbacks (a commit after every batch), the learning rate scaled by the world size and
rescaled by a reset callback. In its first start (``HVDRUN_RESPAWN_COUNT=0``) slot 1 SIGKILLs
itself before its first batch once ``KILL_AT`` batches are committed (-1: never). Every
committed batch records ``(epoch, batch, world size, learning rate)`` in the state, so the history
rolls back with it. Each rank writes its final weights and that history to
``OUT_DIR/final.<slot>.npz``. The model has a ``Dropout`` layer; every batch prints its seed
generator's state and a ``numpy`` draw (``DRAW``): a batch trained again after a recovery must
print what it printed the first time (the commit restores both on the survivor).

Data: epoch ``e``'s batch ``k`` is the same global batch of ``GLOBAL_BATCH`` rows in any world,
dealt over the ranks (rank ``r`` of ``n`` takes rows ``r::n``). After a recovery in the middle of
an epoch the function resumes at ``state.batch`` (Horovod's rule: the batch committed last is
trained again): first the rest of that epoch (Keras runs every epoch of one ``fit`` for the same
number of steps), then the remaining epochs.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import keras
import numpy as np

import hvd_trainer.keras as hvd

out_dir, kill_at = Path(sys.argv[1]), int(sys.argv[2])
zero_stage = int(sys.argv[3]) if len(sys.argv) > 3 else 0  # the optimizer's momentum sharded (torch)
respawn = int(os.environ.get("HVDRUN_RESPAWN_COUNT", "0"))
slot = int(os.environ["RANK"])
STEPS, EPOCHS, GLOBAL_BATCH, LR = 8, 3, 8, 0.02
ALONE_SLEEP_S, PAIR_SLEEP_S = 2.5, 0.1  # alone the survivor waits for the restarted worker to join
JOINER_WAIT_S = 120.0  # alone, first wait (event: the restarted worker's ``started.1`` file)

if respawn > 0:  # the restarted worker has imported Keras; hvd.init() below makes it arrive
    (out_dir / f"started.{slot}").write_text(str(os.getpid()))
hvd.init()
data_rng = np.random.default_rng(0)
X = data_rng.normal(size=(STEPS * GLOBAL_BATCH, 4)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")).astype("float32")
keras.utils.set_random_seed(slot)  # different initial weights: only the state's sync makes them equal
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dropout(0.1), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR * hvd.size(), momentum=0.9),
                                                 zero_stage=zero_stage), loss="mse")
state = hvd.elastic.KerasState(model, batch=0, epoch=0, history=[])


def on_state_reset() -> None:
    model.optimizer.learning_rate = LR * hvd.size()  # Horovod's example rescales the LR here


state.register_reset_callbacks([on_state_reset])


class Batches(keras.utils.PyDataset):
    """Batches ``first .. first + count - 1`` of an epoch, this rank's share of each."""

    def __init__(self, first: int, count: int) -> None:
        super().__init__()
        self.first, self.count = first, count
        self.rank, self.size = hvd.rank(), hvd.size()

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        rows = slice((self.first + i) * GLOBAL_BATCH, (self.first + i + 1) * GLOBAL_BATCH)
        return X[rows][self.rank::self.size], Y[rows][self.rank::self.size]


def _await_joiner() -> None:
    """Alone: wait until slot 1's new process has imported Keras (under a loaded CI host that
    can take longer than the paced steps left)."""
    marker, deadline = out_dir / "started.1", time.monotonic() + JOINER_WAIT_S
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


class Record(keras.callbacks.Callback):
    """Slot 1's kill, the pace, and one history entry per batch (committed by the next callback)."""

    def on_train_batch_begin(self, batch, logs=None) -> None:
        if respawn == 0 and slot == 1 and 0 <= kill_at <= len(state.history):
            print(f"FAIL_AT {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        seed = keras.ops.convert_to_numpy(model.layers[1].seed_generator.state).tolist()
        print(f"DRAW slot={slot} step={len(state.history)} size={hvd.size()} "  # step: batches committed
              f"dropout_seed={seed} numpy={np.random.rand():.8f}", flush=True)
        if hvd.size() == 1 and kill_at >= 0:
            _await_joiner()
        time.sleep(ALONE_SLEEP_S if hvd.size() == 1 else PAIR_SLEEP_S)

    def on_train_batch_end(self, batch, logs=None) -> None:
        lr = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
        state.history.append((state.epoch, state.batch, hvd.size(), lr))


callbacks = [
    hvd.callbacks.MetricAverageCallback(),
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    Record(),
    hvd.elastic.CommitStateCallback(state),
]


@hvd.elastic.run
def train(state: hvd.elastic.KerasState) -> None:
    print(f"START slot={slot} pid={os.getpid()} rank={hvd.rank()} size={hvd.size()} respawn={respawn} "
          f"epoch={state.epoch} batch={state.batch} commits={state.commit_count}", flush=True)
    if state.batch:  # the rest of the interrupted epoch
        model.fit(Batches(state.batch, STEPS - state.batch), epochs=1, callbacks=callbacks, verbose=0)
    model.fit(Batches(0, STEPS), epochs=EPOCHS - state.epoch, callbacks=callbacks, verbose=0)


train(state)
momentum = {f"momentum:{name}": value for name, value in model.optimizer.full_state().items()}
np.savez(out_dir / f"final.{slot}.npz", *model.get_weights(), history=np.array(state.history),
         epoch=state.epoch, batch=state.batch, **momentum)
print(f"DONE slot={slot} pid={os.getpid()} rank={hvd.rank()} size={hvd.size()} epoch={state.epoch}",
      flush=True)

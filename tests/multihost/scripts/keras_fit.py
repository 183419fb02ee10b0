"""Keras 3 ``model.fit`` (torch backend) across hosts with ``DistributedOptimizer``.

Each rank fits its shard; prints ``WEIGHTS <rank> <json>``; rank 0 also prints ``REFERENCE
<json>``: plain Keras in one process on the global batches (every rank's batch of a step).
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hvd_trainer  # noqa: E402
import hvd_trainer.keras as hvd_keras  # noqa: E402

BATCH, STEPS, EPOCHS, LR = 2, 3, 2, 0.1


def _model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


def _flat(model: keras.Model) -> list[float]:
    return [round(float(v), 6) for w in model.get_weights() for v in np.ravel(w)]


def main() -> None:
    hvd_trainer.init()
    rank, size = hvd_trainer.rank(), hvd_trainer.size()
    rng = np.random.default_rng(0)
    g = BATCH * size
    x = rng.normal(size=(STEPS * g, 3)).astype("float32")
    y = rng.normal(size=(STEPS * g, 1)).astype("float32")
    mine = np.concatenate([np.arange(k * g + rank * BATCH, k * g + (rank + 1) * BATCH) for k in range(STEPS)])
    model = _model(seed=5 + rank)  # different per rank: the broadcast callback makes them equal
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    start = _model(seed=5).get_weights()
    model.fit(x[mine], y[mine], batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    print(f"WEIGHTS {rank} {json.dumps(_flat(model))}", flush=True)
    if rank == 0:
        ref = _model(seed=5)
        ref.set_weights(start)
        ref.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
        ref.fit(x, y, batch_size=g, epochs=EPOCHS, shuffle=False, verbose=0)
        print(f"REFERENCE {json.dumps(_flat(ref))}", flush=True)


if __name__ == "__main__":
    main()

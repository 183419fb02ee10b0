"""Keras 3 on the lab (``KERAS_BACKEND`` = ``torch`` or ``tensorflow``): ``model.fit`` with
hvd_trainer's ``DistributedOptimizer`` (``--mode hvd``) or alone (``--mode local``: the compute).

A small CNN on fixed random 32x32 images; a callback times ``--steps`` batches after
``--warmup`` and prints one ``LAB`` record per rank (the record's ``mode`` is
``<backend>_<mode>``).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from bench.lab.workers.common import Window, emit


def _model(keras):  # noqa: ANN001, ANN202
    layers = keras.layers
    inputs = keras.Input((32, 32, 3))
    x = inputs
    for width in (32, 64, 128):
        x = layers.Conv2D(width, 3, padding="same", activation="relu")(x)
        x = layers.Conv2D(width, 3, padding="same", activation="relu")(x)
        x = layers.MaxPooling2D()(x)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10)(x))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("hvd", "local"), required=True)
    p.add_argument("--round", type=int, default=0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    import keras

    backend = keras.backend.backend()
    keras.utils.set_random_seed(0)
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    world, callbacks = 1, []
    if args.mode == "hvd":
        import hvd_trainer
        import hvd_trainer.keras as hvd_keras

        hvd_trainer.init()
        world = hvd_trainer.size()
        opt = hvd_keras.DistributedOptimizer(opt)
        callbacks.append(hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0))
    window = Window()

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):  # noqa: ANN001
            if batch == args.warmup:
                window.start()

        def on_train_end(self, logs=None):  # noqa: ANN001
            emit(workload="keras", mode=f"{backend}_{args.mode}", round=args.round, steps=args.steps,
                 batch=args.batch, world=world, **window.stop())

    model = _model(keras)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(int(os.environ.get("RANK", "0")))
    n = (args.warmup + args.steps) * args.batch
    x = rng.standard_normal((n, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, n)
    model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[*callbacks, Timer()])


if __name__ == "__main__":
    main()

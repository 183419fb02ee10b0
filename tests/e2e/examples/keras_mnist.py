"""What Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py does, on Keras 3.

Changed as the README's porting table says: ``import horovod.tensorflow.keras as hvd`` ->
``import hvd_trainer.keras as hvd``, ``compile(experimental_run_tf_function=False)`` dropped,
the checkpoint a ``.weights.h5`` file. The LR is scaled by ``hvd.size()`` and warmed up, the
optimizer is ``hvd.DistributedOptimizer(backward_passes_per_step=1,
average_aggregated_gradients=True)``, ``steps_per_epoch`` is divided by ``hvd.size()``.
"""

from __future__ import annotations

import os
import sys

import keras
import numpy as np

import hvd_trainer.keras as hvd  # was: import horovod.tensorflow.keras as hvd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from standin import mnist, report  # noqa: E402


def main() -> None:
    hvd.init()
    x, y = mnist(256, seed=hvd.rank())
    x = np.transpose(x, (0, 2, 3, 1))  # channels last, as the example's tf.data pipeline
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.MaxPooling2D(4),
        keras.layers.Flatten(),
        keras.layers.Dense(10, activation="softmax"),
    ])
    scaled_lr = 0.002 * hvd.size()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr), backward_passes_per_step=1,
                                   average_aggregated_gradients=True)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
    ]
    checkpoint = os.path.join(os.environ["EXAMPLE_OUT"], "checkpoint-{epoch}.weights.h5")
    if hvd.rank() == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint(checkpoint, save_weights_only=True))
    history = model.fit(x, y, batch_size=16, steps_per_epoch=16 // hvd.size(), callbacks=callbacks,
                        epochs=3, verbose=1 if hvd.rank() == 0 else 0)
    weights = np.concatenate([np.asarray(w).ravel() for w in model.get_weights()])
    report("keras_mnist", hvd.rank(), loss=[float(v) for v in history.history["loss"]],
           weights=weights.tolist())


if __name__ == "__main__":
    main()

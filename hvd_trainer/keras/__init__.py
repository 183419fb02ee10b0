"""Keras 3 support (``KERAS_BACKEND=tensorflow`` or ``torch``), named like
``horovod.tensorflow.keras``::

    import os; os.environ["KERAS_BACKEND"] = "torch"    # before keras is imported
    import keras, hvd_trainer
    import hvd_trainer.keras as hvd_keras
    hvd_trainer.init()
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd_trainer.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x, y, callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd_keras.callbacks.MetricAverageCallback()],
              verbose=1 if hvd_trainer.rank() == 0 else 0)

Importing this module imports Keras, so ``KERAS_BACKEND`` must be set first.
"""

from __future__ import annotations

from hvd_trainer.comm import Average, Sum
from hvd_trainer.keras import callbacks
from hvd_trainer.keras.compression import Compression
from hvd_trainer.keras.optimizer import DistributedOptimizer, DistributedOptimizerError

__all__ = [
    "DistributedOptimizer", "DistributedOptimizerError", "Compression", "callbacks",
    "Average", "Sum",
]

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

``import hvd_trainer.keras as hvd`` also gives Horovod's module-level names: ``hvd.init()``,
``hvd.size()``, ``hvd.rank()``, ``hvd.local_rank()``, ``hvd.allreduce(value)``,
``hvd.allgather(value)``, ``hvd.broadcast(value, root_rank)``, ``hvd.broadcast_variables(vars,
root_rank)``, the process sets (``ProcessSet``, ``add_process_set``, ``remove_process_set``,
``global_process_set``), ``hvd.load_model(path)``, ``hvd.PartialDistributedOptimizer(opt, local_layers=...)``
and ``hvd.elastic`` (``KerasState``, ``run`` and the elastic callbacks).

Importing this module imports Keras, so ``KERAS_BACKEND`` must be set first.
"""

from __future__ import annotations

from hvd_trainer.comm import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather_object,
    broadcast_object,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
)
from hvd_trainer.keras import (
    callbacks,
    elastic,
    mpi_ops,  # noqa: F401 - Horovod code reaches hvd.mpi_ops._basics
)
from hvd_trainer.keras.callbacks.broadcast import broadcast_variables
from hvd_trainer.keras.collectives import KerasCollectiveError, allgather, allreduce, broadcast
from hvd_trainer.keras.compression import Compression
from hvd_trainer.keras.load import load_model
from hvd_trainer.keras.optimizer import DistributedOptimizer, DistributedOptimizerError
from hvd_trainer.keras.partial import PartialDistributedOptimizer

__all__ = [
    "DistributedOptimizer", "DistributedOptimizerError", "PartialDistributedOptimizer", "Compression",
    "callbacks", "elastic", "load_model",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "allreduce", "allgather", "broadcast", "broadcast_variables", "broadcast_object",
    "allgather_object", "KerasCollectiveError",
]

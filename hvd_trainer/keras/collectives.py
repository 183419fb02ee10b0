"""Collectives on Keras values, named as in ``horovod.tensorflow.keras``.

``allreduce``, ``allgather`` and ``broadcast`` take a Keras/backend tensor, a numpy array or a
Python number and return a backend tensor (``keras.ops.convert_to_tensor``) of the reduced value.
They run eagerly; on the TensorFlow backend a symbolic tensor (inside ``tf.function``) goes
through ``tf.numpy_function``, so the same call also works in a traced ``train_step``. Every rank
must call them in the same order with the same shapes (allgather: the same trailing shape).

Example:
    >>> import hvd_trainer.keras as hvd
    >>> hvd.init()
    >>> mean_loss = float(hvd.allreduce(loss_value))          # average over ranks
    >>> everything = hvd.allgather(predictions)               # (sum of N_r, ...) rows
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import torch

import hvd_trainer.comm as comm
from hvd_trainer.comm import (
    Compression,
    Compressor,
    ReduceOp,
    get_world,
    numpy_to_wire,
    op_or_average,
    to_reduce_op,
)

__all__ = ["allreduce", "allgather", "broadcast", "KerasCollectiveError"]


class KerasCollectiveError(ValueError):
    """Contradictory or invalid arguments to a Keras-level collective (e.g. ``average`` and
    ``op``, or an unknown ``compression``)."""


def _resolve_op(average: bool | None, op: ReduceOp | str | None) -> ReduceOp:
    try:
        merged = op_or_average(op, average)
    except ValueError as exc:  # both given: the comm layer's message, as our error
        raise KerasCollectiveError(f"allreduce {exc}") from None
    return to_reduce_op(merged)


def _run(value: Any, fn: Callable[[np.ndarray], np.ndarray], leading_dim_changes: bool = False) -> Any:
    """Apply the numpy-level collective ``fn`` to ``value`` and return a backend tensor."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if tf.is_tensor(value) and not tf.executing_eagerly():
            out = tf.numpy_function(lambda a: fn(np.asarray(a)), [value], Tout=value.dtype, stateful=True)
            shape = value.shape
            if leading_dim_changes and shape.rank:
                shape = tf.TensorShape([None]).concatenate(shape[1:])
            out.set_shape(shape)
            return out
    array = np.asarray(keras.ops.convert_to_numpy(value))
    return keras.ops.convert_to_tensor(fn(array))


def _as_torch(array: np.ndarray) -> tuple[torch.Tensor, np.dtype]:
    """``array`` as a CPU tensor in comm's wire dtype (one set for every flattening path, see
    :func:`hvd_trainer.comm.ops.flatten.numpy_wire_dtype`), and the dtype to convert back to."""
    return numpy_to_wire(array)


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: ReduceOp | str | None = None,
    compression: Compressor | type[Compressor] | str | None = None,
) -> Any:
    """Reduce ``value`` over all ranks (default: average).

    Args:
        value: tensor/array/number of any shape and a numeric dtype; same shape on every rank.
        name: label for cross-rank checks and the timeline.
        average: Horovod's older flag (True = Average, False = Sum); do not combine with ``op``.
        prescale_factor / postscale_factor: multiply before / after the reduction.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        compression: wire format only: ``None``, ``Compression.fp16`` / ``.bf16`` / ``.none``, a
            ``Compressor`` subclass or ``"none"``/``"fp16"``/``"bf16"``. The comm allreduce scales
            before the cast (fp16: by the set size and a global power of two), so values that
            fit float32 do not overflow.

    Returns:
        A backend tensor with the shape and dtype of ``value``.

    Raises:
        KerasCollectiveError: both ``average`` and ``op`` were given, or ``compression`` is not
            a compressor.
        hvd_trainer.CollectiveMismatchError: shapes or dtypes differ across ranks.
    """
    rop = _resolve_op(average, op)
    compressor = Compression.resolve(compression, error=KerasCollectiveError)

    def reduce(array: np.ndarray) -> np.ndarray:
        tensor, dtype = _as_torch(array)
        out = comm.allreduce(tensor, op=rop, name=name or "keras.allreduce", prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, compression=compressor, world=get_world())
        return out.numpy().astype(dtype, copy=False)

    return _run(value, reduce)


def allgather(value: Any, name: str | None = None) -> Any:
    """Concatenate every rank's ``value`` along dimension 0, in rank order.

    Args:
        value: tensor/array of shape ``(N_r, ...)``; ``N_r`` may differ per rank, the trailing
            dimensions and the dtype may not. A scalar is gathered as shape ``(1,)``.

    Returns:
        A backend tensor of shape ``(sum_r N_r, ...)``.
    """

    def gather(array: np.ndarray) -> np.ndarray:
        tensor, dtype = _as_torch(np.atleast_1d(array))
        out = comm.allgather(tensor, name=name or "keras.allgather", world=get_world())
        return out.numpy().astype(dtype, copy=False)

    return _run(value, gather, leading_dim_changes=True)


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """Return ``root_rank``'s ``value`` on every rank (same shape and dtype everywhere)."""

    def bcast(array: np.ndarray) -> np.ndarray:
        tensor, dtype = _as_torch(array)
        tensor = tensor.clone()
        comm.broadcast_(tensor, root_rank, name=name or "keras.broadcast", world=get_world())
        return tensor.numpy().astype(dtype, copy=False)

    return _run(value, bcast)

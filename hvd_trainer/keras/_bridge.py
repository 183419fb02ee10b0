"""Gradient and variable transport between Keras tensors and the comm layer.

- TensorFlow: gradients leave the graph through ``tf.numpy_function`` (stateful, so it runs
  exactly once per step and in order), are packed into one flat buffer per wire dtype
  (:mod:`hvd_trainer.comm.ops.flatten`), reduced with one comm allreduce each, and come back as
  numpy arrays. On CPU ``torch.from_numpy`` shares memory, so the only copies are the pack and
  TF's copy of the result.
- torch: the Keras variables' ``.value`` are leaf ``torch.nn.Parameter`` s, so the comm
  layer's hook-driven :class:`~hvd_trainer.comm.GradientReducer` reduces them while backward
  runs; ``DistributedOptimizer.apply`` only waits. With ``backward_passes_per_step > 1`` the
  hooks are not installed (Keras' train step zeroes ``.grad`` before every backward, so the
  sums live in separate accumulators) and the N-th ``apply`` does one grouped allreduce.
- Error-feedback compression (``int8``, ``powersgd``) on TensorFlow: the arrays are reduced by
  the comm layer's :func:`~hvd_trainer.comm.reduce.compressed.reduce_with_feedback` under their
  variables' names, with the optimizer's residuals (and PowerSGD's Q).
- Variables (broadcast): numpy in, numpy out, one broadcast per wire dtype.

Arrays travel in their own dtype when it is one of comm's ``SUPPORTED_DTYPES``, else as float32
(e.g. ``ml_dtypes.bfloat16``): :func:`hvd_trainer.comm.ops.flatten.numpy_wire_dtype`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hvd_trainer.comm import (
    Compression,
    Compressor,
    FeedbackState,
    ReduceOp,
    World,
    allreduce_,
    broadcast_,
    flat_collective,
    grouped_allreduce,
    numpy_to_wire,
    reduce_with_feedback,
    wire_to_numpy,
)

__all__ = ["FlatBuffers", "allreduce_arrays", "allreduce_arrays_with_feedback", "broadcast_arrays"]


class FlatBuffers:
    """Reusable flat buffers, two per (dtype, length), handed out alternately.

    Reusing memory avoids allocating (and page-faulting) a gradient-sized array every step.
    Two alternate so the arrays returned for step k (which TensorFlow may alias) are never
    overwritten before step k+2, long after step k's update consumed them.
    """

    def __init__(self) -> None:
        self._slots: dict[tuple[torch.dtype, int], tuple[list[torch.Tensor], list[int]]] = {}

    def get(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """A 1-D CPU tensor of ``numel`` elements of ``dtype`` (``device`` is always the CPU here)."""
        bufs, turn = self._slots.setdefault(
            (dtype, numel), ([torch.empty(numel, dtype=dtype, device=device) for _ in range(2)], [0])
        )
        turn[0] ^= 1
        return bufs[turn[0]]


def _arrays_collective(arrays: Sequence[np.ndarray], collective: Any,
                       buffers: FlatBuffers | None, what: str) -> list[np.ndarray]:
    """Flatten ``arrays`` per wire dtype, run ``collective`` in place on each flat tensor, and
    return the results as arrays of the inputs' dtypes (views of the flat buffers if possible)."""
    wired = [numpy_to_wire(a) for a in arrays]
    tensors = [t for t, _ in wired]
    views = flat_collective(tensors, collective, what=what,
                            buffer=buffers.get if buffers is not None else None)
    return [wire_to_numpy(v, dtype) for v, (_, dtype) in zip(views, wired, strict=True)]


def allreduce_arrays(
    arrays: Sequence[np.ndarray],
    *,
    world: World,
    op: ReduceOp,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Compressor = Compression.none,
    buffers: FlatBuffers | None = None,
    process_set: Any = None,
    on_sent: Callable[[int], None] | None = None,
) -> list[np.ndarray]:
    """Reduce every array over ranks: one fused allreduce per dtype, arrays in rank-equal order.

    Args:
        arrays: numpy arrays of any shapes; the same shapes and dtypes on every rank.
        op: ``Average``, ``Sum`` or ``Adasum`` (each array combined with its own dot products,
            as Horovod reduces each tensor: one grouped Adasum per wire dtype).
        prescale_factor / postscale_factor: multiply before / after the reduction.
        compression: the comm compressor for the wire (``Compression.fp16`` scales before
            the cast; see :mod:`hvd_trainer.comm.ops.compression`).
        buffers: reuse these flat buffers (the result then aliases them; see FlatBuffers).
        process_set: reduce over this :class:`~hvd_trainer.comm.ProcessSet` only (this rank
            must be a member); ``None``: the whole world.
        on_sent: called with the bytes each fused allreduce puts on the wire
            (:meth:`~hvd_trainer.comm.ops.compression.Compressor.allreduce_wire_bytes`).

    Returns:
        New arrays, same shapes and dtypes as ``arrays``.
    """
    size = world.size if process_set is None else process_set.size()
    if op is ReduceOp.ADASUM:
        wired = [numpy_to_wire(a) for a in arrays]
        tensors = [t for t, _ in wired]
        if on_sent is not None:
            on_sent(Compression.resolve(compression).allreduce_wire_bytes(tensors, size, adasum=True))
        reduced = grouped_allreduce(tensors, op=op, name="keras.gradients", prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, compression=compression,
                                    process_set=process_set, world=world)
        return [wire_to_numpy(r, dtype) for r, (_, dtype) in zip(reduced, wired, strict=True)]

    def reduce(flat: torch.Tensor) -> None:
        if on_sent is not None:
            on_sent(Compression.resolve(compression).allreduce_wire_bytes([flat], size))
        allreduce_(flat, op=op, name="keras.gradients", prescale_factor=prescale_factor,
                   postscale_factor=postscale_factor, compression=compression,
                   process_set=process_set, world=world)

    return _arrays_collective(arrays, reduce, buffers, "Keras gradient allreduce")


def allreduce_arrays_with_feedback(
    arrays: Sequence[np.ndarray],
    names: Sequence[str],
    *,
    compressor: Compressor,
    state: FeedbackState,
    world: World,
    op: ReduceOp,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list[np.ndarray]:
    """Reduce every array over ranks with ``compressor``'s error feedback (``int8``, ``powersgd``).

    Args:
        arrays: floating numpy arrays; the same shapes and dtypes on every rank.
        names: one stable name per array (the key of its residual and ``Q`` in ``state``).
        state: the error-feedback state, updated in place.
        Others: as :func:`allreduce_arrays`.

    Returns:
        New arrays, same shapes and dtypes as ``arrays``.
    """
    wired = [numpy_to_wire(a) for a in arrays]
    reduced, _ = reduce_with_feedback(
        [(n, t) for n, (t, _) in zip(names, wired, strict=True)], compressor=compressor, state=state,
        world=world, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        process_set=process_set, name="keras.gradients",
    )
    return [wire_to_numpy(r, dtype) for r, (_, dtype) in zip(reduced, wired, strict=True)]


def broadcast_arrays(arrays: Sequence[np.ndarray], *, root_rank: int, world: World) -> list[np.ndarray]:
    """Return ``root_rank``'s arrays on every rank (one broadcast per wire dtype)."""

    def bcast(flat: torch.Tensor) -> None:
        broadcast_(flat, root_rank, name="keras.variables", world=world)

    return _arrays_collective(arrays, bcast, None, "Keras variable broadcast")


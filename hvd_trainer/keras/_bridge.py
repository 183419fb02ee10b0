"""Gradient and variable transport between Keras tensors and the comm layer.

- TensorFlow: gradients leave the graph through ``tf.numpy_function`` (stateful, so it runs
  exactly once per step and in order), are packed into one flat buffer per dtype, reduced with
  one comm allreduce each, and come back as numpy arrays. On CPU ``torch.from_numpy`` shares
  memory, so the only copies are the pack and TF's copy of the result.
- torch: the Keras variables' ``.value`` are leaf ``torch.nn.Parameter`` s, so the comm
  layer's hook-driven :class:`~hvd_trainer.comm.GradientReducer` reduces them while backward
  runs; ``DistributedOptimizer.apply`` only waits. With ``backward_passes_per_step > 1`` the
  hooks are not installed (Keras' train step zeroes ``.grad`` before every backward, so the
  sums live in separate accumulators) and the N-th ``apply`` does one grouped allreduce.
- Variables (broadcast): numpy in, numpy out, one broadcast per dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hvd_trainer.comm import allreduce_, broadcast_
from hvd_trainer.comm.compression import Compression, Compressor
from hvd_trainer.comm.ops import ReduceOp
from hvd_trainer.comm.world import World

__all__ = ["FlatBuffers", "allreduce_arrays", "broadcast_arrays"]

# numpy dtypes torch.from_numpy accepts; anything else (e.g. ml_dtypes.bfloat16) travels as float32.
_TORCH_OK = {np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64", "uint8")}


def _groups(arrays: Sequence[np.ndarray]) -> dict[np.dtype, list[int]]:
    groups: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(np.dtype(a.dtype), []).append(i)
    return groups


class FlatBuffers:
    """Reusable flat buffers, two per (dtype, length), handed out alternately.

    Reusing memory avoids allocating (and page-faulting) a gradient-sized array every step.
    Two alternate so the arrays returned for step k (which TensorFlow may alias) are never
    overwritten before step k+2, long after step k's update consumed them.
    """

    def __init__(self) -> None:
        self._slots: dict[tuple[np.dtype, int], tuple[list[np.ndarray], list[int]]] = {}

    def get(self, dtype: np.dtype, numel: int) -> np.ndarray:
        bufs, turn = self._slots.setdefault((dtype, numel), ([np.empty(numel, dtype) for _ in range(2)], [0]))
        turn[0] ^= 1
        return bufs[turn[0]]


def _pack(arrays: Sequence[np.ndarray], idx: list[int],
          buffers: FlatBuffers | None = None) -> tuple[np.ndarray, np.dtype]:
    dtype = np.dtype(arrays[idx[0]].dtype)
    wire = dtype if dtype in _TORCH_OK else np.dtype("float32")
    parts = [np.asarray(arrays[i], dtype=wire).ravel() for i in idx]
    if buffers is None:
        return np.concatenate(parts), dtype
    flat = buffers.get(wire, sum(p.size for p in parts))
    np.concatenate(parts, out=flat)
    return flat, dtype


def _unpack(flat: np.ndarray, arrays: Sequence[np.ndarray], idx: list[int], dtype: np.dtype,
            out: list[Any]) -> None:
    offset = 0
    for i in idx:
        n = int(np.prod(arrays[i].shape, dtype=np.int64))
        out[i] = flat[offset : offset + n].reshape(arrays[i].shape).astype(dtype, copy=False)
        offset += n


def allreduce_arrays(
    arrays: Sequence[np.ndarray],
    *,
    world: World,
    op: ReduceOp,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Compressor = Compression.none,
    buffers: FlatBuffers | None = None,
) -> list[np.ndarray]:
    """Reduce every array over ranks: one fused allreduce per dtype, arrays in rank-equal order.

    Args:
        arrays: numpy arrays of any shapes; the same shapes and dtypes on every rank.
        op: ``Average`` or ``Sum``.
        prescale_factor / postscale_factor: multiply before / after the reduction.
        compression: the comm compressor for the wire (``Compression.fp16`` scales before
            the cast; see :mod:`hvd_trainer.comm.compression`).
        buffers: reuse these flat buffers (the result then aliases them; see FlatBuffers).

    Returns:
        New arrays, same shapes and dtypes as ``arrays``.
    """
    out: list[Any] = [None] * len(arrays)
    for idx in _groups(arrays).values():
        flat, dtype = _pack(arrays, idx, buffers)
        tensor = torch.from_numpy(flat)
        allreduce_(tensor, op=op, name="keras.gradients", prescale_factor=prescale_factor,
                   postscale_factor=postscale_factor, compression=compression, world=world)
        _unpack(tensor.numpy(), arrays, idx, dtype, out)
    return out


def broadcast_arrays(arrays: Sequence[np.ndarray], *, root_rank: int, world: World) -> list[np.ndarray]:
    """Return ``root_rank``'s arrays on every rank (one broadcast per dtype)."""
    out: list[Any] = [None] * len(arrays)
    for idx in _groups(arrays).values():
        flat, dtype = _pack(arrays, idx)
        broadcast_(torch.from_numpy(flat), root_rank, name="keras.variables", world=world)
        _unpack(flat, arrays, idx, dtype, out)
    return out

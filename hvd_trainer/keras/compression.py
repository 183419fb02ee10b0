"""Gradient compression for the wire (Horovod's ``Compression.none`` / ``Compression.fp16``).

A compressor has ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``
on torch tensors; it applies to the TensorFlow bridge of :class:`DistributedOptimizer`.
"""

from __future__ import annotations

import torch

__all__ = ["Compression", "NoneCompressor", "FP16Compressor"]


class NoneCompressor:
    """Send gradients as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: None) -> torch.Tensor:
        return tensor


class FP16Compressor:
    """Send floating-point gradients as float16 (half the bytes; about 3 significant digits)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        if tensor.is_floating_point() and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class Compression:
    """Namespace of compressors, as in ``horovod.tensorflow.keras.Compression``."""

    none = NoneCompressor
    fp16 = FP16Compressor

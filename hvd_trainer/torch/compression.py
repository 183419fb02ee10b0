"""``horovod.torch.compression``'s module path: :class:`Compression` and the compressors of
:mod:`hvd_trainer.comm.ops.compression`, under Horovod's import path. Nothing is defined here."""

from __future__ import annotations

from hvd_trainer.comm import (
    BF16Compressor,
    Compression,
    CompressionError,
    Compressor,
    FP16Compressor,
    NoneCompressor,
)

__all__ = [
    "Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor",
    "CompressionError",
]

"""Gradient compression for the wire (Horovod's ``Compression.none`` / ``fp16`` / ``bf16``, and
the error-feedback ``Compression.int8`` / ``Compression.powersgd(rank=r)``).

``hvd_trainer.keras.Compression`` *is* the comm layer's
:class:`~hvd_trainer.comm.ops.compression.Compression`, so one set of compressors serves both
Keras backends: the TensorFlow bridge and the torch path hand it to the comm allreduce, which
scales before the cast (fp16: a global power-of-two scale, so sums cannot overflow).
``compression=`` arguments are resolved by :meth:`Compression.resolve`, as in every front end.
``int8`` and ``powersgd`` keep a residual per variable, so only
:class:`~hvd_trainer.keras.DistributedOptimizer` accepts them (:func:`resolve_compression`,
used by the collectives, refuses them).
"""

from __future__ import annotations

from typing import Any

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
    "CompressionError", "resolve_compression",
]


def resolve_compression(compression: Any) -> Compressor:
    """The comm :class:`Compressor` for ``compression`` (:meth:`Compression.resolve`).

    Accepts ``None``, ``"none"``/``"fp16"``/``"bf16"``, a compressor instance
    (``Compression.fp16``) or a compressor class (``FP16Compressor``, instantiated here).

    Raises:
        CompressionError: anything else (the message echoes the value).
    """
    return Compression.resolve(compression)

"""Gradient compression for the wire (Horovod's ``Compression.none`` / ``fp16`` / ``bf16``).

``hvd_trainer.keras.Compression`` *is* the comm layer's
:class:`~hvd_trainer.comm.compression.Compression`, so one set of compressors serves both
Keras backends: the TensorFlow bridge and the torch path hand it to the comm allreduce, which
scales before the cast (fp16: a global power-of-two scale, so sums cannot overflow).
"""

from __future__ import annotations

from typing import Any

from hvd_trainer.comm.compression import (
    BF16Compressor,
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
)

__all__ = [
    "Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor",
    "CompressionError", "resolve_compression",
]


class CompressionError(ValueError):
    """``compression=`` is not a known compressor."""


def resolve_compression(compression: Any) -> Compressor:
    """Return the comm :class:`Compressor` for ``compression``.

    Accepts ``None`` (no compression), a compressor instance (``Compression.fp16``) or a
    compressor class (``FP16Compressor``, instantiated here).

    Raises:
        CompressionError: anything else (the message echoes the value).
    """
    if compression is None:
        return Compression.none
    if isinstance(compression, Compressor):
        return compression
    if isinstance(compression, type) and issubclass(compression, Compressor):
        return compression()
    raise CompressionError(
        f"compression={compression!r} is not a compressor. HINT: pass "
        "hvd_trainer.keras.Compression.none, .fp16 or .bf16."
    )

"""Wire compression for allreduce: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``.

A compressor casts floating tensors to a narrower *wire* dtype before the transport and back
to the original dtype after it; other dtypes pass through unchanged (Horovod's interface:
``compress(t) -> (t, ctx)``, ``decompress(t, ctx) -> t``).

Numerics (applied by the allreduce path, :mod:`hvd_trainer.comm.reduce`):

* scale *before* the cast: ``prescale_factor`` and, for ``Average``, the division by the set
  size are applied in the original precision, so a sum of N fp16 values cannot exceed the
  largest single value (the same order as DDP's ``fp16_compress_hook``: "divide first");
* ``fp16`` additionally multiplies by a power of two ``2**k`` chosen from the global maximum
  magnitude (one extra 4-byte allreduce) so that ``N * max|x| * 2**k <= 2**15``; values that
  fit fp32 therefore never overflow to ``inf``, and small values use fp16's precision instead of
  underflowing. Powers of two make the scaling exact. ``bf16`` has fp32's exponent range and
  needs no extra step.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class Compressor:
    """Interface: cast for the wire and back. ``wire_dtype`` is ``None`` for no compression."""

    name = "none"
    wire_dtype: torch.dtype | None = None

    def applies_to(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is cast (floating and wider than the wire dtype)."""
        wire = self.wire_dtype
        return wire is not None and tensor.is_floating_point() and tensor.dtype != wire

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return ``(wire_tensor, ctx)``; ``ctx`` is the original dtype."""
        if not self.applies_to(tensor):
            return tensor, None
        return tensor.to(self.wire_dtype), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Undo :meth:`compress`."""
        return tensor if ctx is None else tensor.to(ctx)

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class NoneCompressor(Compressor):
    """No compression."""


class FP16Compressor(Compressor):
    """Cast floating tensors to float16 on the wire (with global power-of-two scaling)."""

    name = "fp16"
    wire_dtype = torch.float16
    needs_global_scale = True


class BF16Compressor(Compressor):
    """Cast floating tensors to bfloat16 on the wire (fp32 exponent range: no scaling)."""

    name = "bf16"
    wire_dtype = torch.bfloat16
    needs_global_scale = False


class Compression:
    """Namespace of the available compressors (``Compression.fp16`` ...)."""

    none: Compressor = NoneCompressor()
    fp16: Compressor = FP16Compressor()
    bf16: Compressor = BF16Compressor()


FP16_TARGET_MAX = 2.0**15
"""``fp16`` scaling targets a global sum magnitude of at most 2**15 (fp16 max is 65504)."""


def fp16_scale_exponent(global_absmax: float, size: int) -> int:
    """Exponent ``k`` such that ``size * global_absmax * 2**k <= 2**15`` (0 for 0/inf/nan)."""
    bound = global_absmax * size
    if not bound > 0 or bound == float("inf"):
        return 0
    mantissa, exponent = torch.frexp(torch.tensor(bound, dtype=torch.float64))
    del mantissa
    # bound < 2**exponent, so 2**(15 - exponent) * bound < 2**15.
    return max(-120, min(120, 15 - int(exponent)))

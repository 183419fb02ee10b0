"""Wire compression for allreduce: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``,
and for gradient buckets only ``Compression.int8`` and ``Compression.powersgd(rank=r)``.

A compressor casts floating tensors to a narrower *wire* dtype before the transport and back
to the original dtype after it; other dtypes pass through unchanged (Horovod's interface:
``compress(t) -> (t, ctx)``, ``decompress(t, ctx) -> t``).

Numerics (applied by the allreduce path, :mod:`hvd_trainer.comm.ops.reduce`):

* scale *before* the cast: ``prescale_factor`` and, for ``Average``, the division by the set
  size are applied in the original precision, so a sum of N fp16 values cannot exceed the
  largest single value (the same order as DDP's ``fp16_compress_hook``: "divide first");
* ``fp16`` additionally multiplies by a power of two ``2**k`` chosen from the global maximum
  magnitude (one extra 4-byte allreduce) so that ``N * max|x| * 2**k <= 2**15``; values that
  fit fp32 therefore never overflow to ``inf``, and small values use fp16's precision instead of
  underflowing. Powers of two make the scaling exact. ``bf16`` has fp32's exponent range and
  needs no extra step.

``int8`` and ``powersgd`` are lossy and carry *error feedback* (what the wire lost this step is
added to the next step's gradient), i.e. training state per parameter: they are specs here, the
algorithms and their state live in :mod:`hvd_trainer.comm.reduce.compressed`, and only the gradient
reducer (the torch and Keras ``DistributedOptimizer``, ``HorovodStrategy``) accepts them; a plain
``allreduce`` rejects them (:meth:`Compression.resolve` with ``allow_error_feedback=False``).

Every front end (the Lightning strategy, the torch and Keras ``DistributedOptimizer``, the Keras
collectives) turns its ``compression=`` argument into a compressor with the one resolver
:meth:`Compression.resolve`, so they accept exactly the same values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hvd_trainer.comm.base.errors import CommValueError

__all__ = [
    "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression",
    "CompressionError", "ErrorFeedbackCompressor", "Int8Compressor", "PowerSGDCompressor",
    "AUTO", "DEFAULT_POWERSGD_RANK", "DEFAULT_POWERSGD_WARMUP_STEPS", "compression_spellings",
]

_WIRE_DTYPES = (None, torch.float16, torch.bfloat16)
"""Wire dtypes the allreduce path supports (``None``: no cast)."""

AUTO = "auto"
"""``compression="auto"`` (and ``sync_every="auto"``): the gradient front ends check for it before
:meth:`Compression.resolve` and choose from the measured link (:mod:`hvd_trainer.comm.reduce.auto`)."""

_CAST_SPELLINGS = ("none", "fp16", "bf16")
_ERROR_FEEDBACK_SPELLINGS = ("int8", "powersgd", "powersgd:R")


def compression_spellings(*, allow_error_feedback: bool = False, allow_auto: bool = False) -> tuple[str, ...]:
    """The ``compression=`` strings a front end accepts, as its errors list them.

    The one list of spellings: :meth:`Compression.resolve` accepts exactly these (``"powersgd:R"``
    standing for ``"powersgd:4"`` etc.), and ``"auto"`` where the front end resolves it itself.

    Args:
        allow_error_feedback: add ``"int8"``, ``"powersgd"``, ``"powersgd:R"`` (gradient reducers).
        allow_auto: add ``"auto"`` (the torch and Keras ``DistributedOptimizer``, ``HorovodStrategy``).
    """
    return (_CAST_SPELLINGS + (_ERROR_FEEDBACK_SPELLINGS if allow_error_feedback else ())
            + ((AUTO,) if allow_auto else ()))


class CompressionError(CommValueError):
    """``compression=`` is not a compressor the allreduce path can honour."""


class Compressor:
    """Interface: cast for the wire and back. ``wire_dtype`` is ``None`` for no compression.

    The allreduce path does not call :meth:`compress`/:meth:`decompress`: it reads
    ``wire_dtype`` and casts itself, after scaling (see the module docstring). A subclass
    therefore sets ``name`` and ``wire_dtype`` only; :meth:`Compression.resolve` rejects one
    that overrides ``compress`` or ``decompress`` instead of ignoring them silently.
    """

    name = "none"
    wire_dtype: torch.dtype | None = None
    error_feedback = False
    """Whether this is a stateful, error-feedback algorithm (``int8``, ``powersgd``)."""

    @property
    def needs_global_scale(self) -> bool:
        """Whether the allreduce applies fp16's global power-of-two scale (fp16 wire only)."""
        return self.wire_dtype == torch.float16

    def applies_to(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is cast (floating and wider than the wire dtype)."""
        wire = self.wire_dtype
        return wire is not None and tensor.is_floating_point() and tensor.dtype != wire

    def allreduce_wire_bytes(self, tensors: Sequence[torch.Tensor], set_size: int, *,
                             adasum: bool = False) -> int:
        """Bytes one rank puts on the wire to allreduce ``tensors`` (each in its wire dtype:
        cast where :meth:`applies_to`) over ``set_size`` ranks, counted as a ring allreduce
        sends them: ``2 (N-1)/N`` of the payload; with ``adasum`` (an allgather, then the
        combination on every rank) ``N-1`` times it; headers not included."""
        payload = sum(t.numel() * (torch.empty((), dtype=self.wire_dtype).element_size()
                                   if self.applies_to(t) else t.element_size()) for t in tensors)
        if adasum:
            return (set_size - 1) * payload
        return 2 * (set_size - 1) * payload // set_size

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


class BF16Compressor(Compressor):
    """Cast floating tensors to bfloat16 on the wire (fp32 exponent range: no scaling)."""

    name = "bf16"
    wire_dtype = torch.bfloat16


class ErrorFeedbackCompressor(Compressor):
    """Base of the lossy bucket algorithms with error feedback (no cast: ``wire_dtype`` None).

    The reducer keeps, per parameter, the residual ``e`` (fp32, of the gradient already
    multiplied by the pre-sum factor, ``1/N`` for Average) and sends ``compress(g + e)``;
    ``e = (g + e) - decompress(compress(g + e))`` is carried to the next step.
    """

    error_feedback = True

    def applies_to(self, tensor: torch.Tensor) -> bool:
        return False  # never a cast

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(vars(self).items()))))


class Int8Compressor(ErrorFeedbackCompressor):
    """int8 with one fp32 scale (``absmax / 127``) per block of ``block_size`` values.

    Wire, for ``n`` values in ``b = ceil(n / block_size)`` blocks over ``N`` ranks: where
    ``b > 2 ceil(b / N)`` (3 ranks or more, buckets of a few blocks and up), a reduce-scatter of
    int8 chunks (all-to-all), each chunk's sum requantised by its owner, then an allgather of the
    requantised chunks: ``2 (N-1)/N * (n + 4 n / block_size)`` bytes per rank (each chunk padded
    to whole blocks), 3.9x fewer than fp32 ring allreduce at every ``N`` for large buckets.
    Otherwise (2 ranks, small buckets) an allgather of every rank's int8 and scales,
    ``(N-1) * (n + 4 n / block_size)`` bytes. Sums are fp32 in rank order, the same on every
    rank (:mod:`hvd_trainer.comm.reduce.compressed.reductions`).
    """

    def __init__(self, block_size: int = 256) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 4 \
                or block_size % 4:
            raise CompressionError(
                f"Int8Compressor(block_size={block_size!r}) must be a multiple of 4 (the fp32 scales "
                "follow the int8 values in one buffer). HINT: block_size=256."
            )
        self.block_size = block_size
        self.name = "int8" if block_size == 256 else f"int8(block_size={block_size})"


DEFAULT_POWERSGD_RANK = 16
"""PowerSGD's rank when none is given (``Compression.powersgd()``, ``"powersgd"``, ``"auto"``'s
choice); the README's "Slow links" has the sweep it was chosen from."""

DEFAULT_POWERSGD_WARMUP_STEPS = 128
"""Plain fp32 reductions of each gradient before PowerSGD starts (``sync_warmup_steps``)."""


class PowerSGDCompressor(ErrorFeedbackCompressor):
    """PowerSGD (Vogels et al. 2019, arXiv:1905.13727): rank-``r`` approximation ``P Q^T`` of
    each gradient matrix (a tensor reshaped to ``dim0 x rest``), one power iteration per step
    warm-started from the previous ``Q``, with error feedback. 1-D tensors, tensors under
    ``min_compress_numel`` values and those a rank-``r`` factorisation would not shrink
    (``(n + m) r >= n m``) are sent uncompressed (fp32 sum) together with the ``P`` factors.

    The first ``sync_warmup_steps`` reductions of each gradient are plain fp32 allreduces (no
    residual, no ``Q`` update); compression starts after them from a zero residual. This is
    torch DDP's ``PowerSGDState(start_powerSGD_iter=...)``: a low-rank approximation of the
    large, fast-changing gradients of the first steps costs more quality than it saves bytes.
    With ``backward_passes_per_step`` a reduction is one accumulation window.
    """

    def __init__(self, rank: int = DEFAULT_POWERSGD_RANK, min_compress_numel: int = 1024,
                 seed: int = 0, sync_warmup_steps: int = DEFAULT_POWERSGD_WARMUP_STEPS) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise CompressionError(f"Compression.powersgd(rank={rank!r}): rank must be an int >= 1.")
        if not isinstance(min_compress_numel, int) or min_compress_numel < 0:
            raise CompressionError(f"min_compress_numel={min_compress_numel!r} must be an int >= 0.")
        if isinstance(sync_warmup_steps, bool) or not isinstance(sync_warmup_steps, int) \
                or sync_warmup_steps < 0:
            raise CompressionError(
                f"Compression.powersgd(sync_warmup_steps={sync_warmup_steps!r}) must be an int >= 0 "
                f"(0: compress from the first step). HINT: the default is {DEFAULT_POWERSGD_WARMUP_STEPS}.")
        self.rank = rank
        self.min_compress_numel = min_compress_numel
        self.seed = seed
        self.sync_warmup_steps = sync_warmup_steps
        self.name = f"powersgd(rank={rank})"


class Compression:
    """Namespace of the available compressors (``Compression.fp16`` ...) and their resolver."""

    none: Compressor = NoneCompressor()
    fp16: Compressor = FP16Compressor()
    bf16: Compressor = BF16Compressor()
    int8: Compressor = Int8Compressor()

    @staticmethod
    def powersgd(rank: int = DEFAULT_POWERSGD_RANK, min_compress_numel: int = 1024,
                 sync_warmup_steps: int = DEFAULT_POWERSGD_WARMUP_STEPS) -> Compressor:
        """PowerSGD of rank ``rank`` with error feedback, after ``sync_warmup_steps`` plain
        reductions (:class:`PowerSGDCompressor`)."""
        return PowerSGDCompressor(rank=rank, min_compress_numel=min_compress_numel,
                                  sync_warmup_steps=sync_warmup_steps)

    @staticmethod
    def resolve(value: Any, *, error: type[Exception] = CompressionError,
                allow_error_feedback: bool = False, allow_auto: bool = False) -> Compressor:
        """The compressor for a ``compression=`` argument; the one resolver of every front end.

        Accepts ``None`` (no compression), the strings ``"none"``, ``"fp16"``, ``"bf16"``,
        ``"int8"``, ``"powersgd"`` (rank :data:`DEFAULT_POWERSGD_RANK`) or ``"powersgd:R"`` (any case), a
        :class:`Compressor` instance, or a :class:`Compressor` subclass (instantiated without
        arguments).

        Args:
            value: what the user passed as ``compression=``.
            error: the exception class to raise (a front end passes its own argument error).
            allow_error_feedback: accept ``int8``/``powersgd`` (only the gradient reducer can
                honour them: they keep per-parameter state).
            allow_auto: the caller accepts ``"auto"`` (it checks for :data:`AUTO` and chooses
                from the measured link itself, before this call): errors list it.

        Raises:
            CompressionError (or ``error``): anything else; a compressor whose ``wire_dtype`` is
                not ``None``/``torch.float16``/``torch.bfloat16``; a subclass that overrides
                ``compress``/``decompress`` (the allreduce casts itself and would ignore them).
                The message echoes the value.
        """
        if value is None:
            return Compression.none
        received = value  # echoed in errors as the caller wrote it
        if isinstance(value, str) and value.lower().startswith("powersgd"):
            value = _powersgd_from_string(value, error)
        if isinstance(value, str) and value.lower() in _BY_NAME:
            value = _BY_NAME[value.lower()]
        if isinstance(value, type) and issubclass(value, Compressor):
            value = value()
        if not isinstance(value, Compressor):
            raise error(f"compression={value!r} is not a compressor. HINT: use one of "
                        f"{_spelling_hint(allow_error_feedback, allow_auto)}.")
        _check_compressor(value, error)
        if value.error_feedback and not allow_error_feedback:
            raise error(
                f"compression={received!r} keeps error-feedback state per parameter, which only the "
                "DistributedOptimizer (torch or Keras) and HorovodStrategy hold. HINT: use it there; "
                "here use Compression.fp16 / .bf16 (or 'fp16' / 'bf16')."
            )
        return value


_BY_NAME: dict[str, Compressor] = {
    "none": Compression.none, "fp16": Compression.fp16, "bf16": Compression.bf16,
    "int8": Compression.int8,
}
"""The fixed spellings (``"powersgd[:R]"`` is parsed); :func:`compression_spellings` lists them all."""


def _spelling_hint(allow_error_feedback: bool, allow_auto: bool) -> str:
    """``'none', 'fp16', ... or 'auto', or a Compressor such as ...``: what an error lists."""
    names = [repr(n) + (" (R >= 1, e.g. 'powersgd:4')" if n.endswith(":R") else "")
             for n in compression_spellings(allow_error_feedback=allow_error_feedback, allow_auto=allow_auto)]
    return f"{', '.join(names[:-1])} or {names[-1]}, or a Compressor such as hvd_trainer.Compression.fp16"


def _powersgd_from_string(value: str, error: type[Exception]) -> Compressor:
    """``"powersgd"`` (rank :data:`DEFAULT_POWERSGD_RANK`) or ``"powersgd:R"``."""
    _, _, rank = value.partition(":")
    if not rank:
        return Compression.powersgd()
    if not rank.isdigit() or int(rank) < 1:
        raise error(f"compression={value!r}: expected 'powersgd' or 'powersgd:R' with R >= 1. "
                    "HINT: e.g. 'powersgd:4'.")
    return Compression.powersgd(rank=int(rank))


def _check_compressor(value: Compressor, error: type[Exception]) -> None:
    """Reject what the allreduce path could not honour (it reads only ``wire_dtype``/``name``)."""
    if value.error_feedback:
        if not isinstance(value, (Int8Compressor, PowerSGDCompressor)):
            raise error(
                f"compression={value!r}: the reducer implements Compression.int8 and "
                "Compression.powersgd(rank=r) only. HINT: use one of those."
            )
        return
    cls = type(value)
    overridden = [m for m in ("compress", "decompress") if getattr(cls, m) is not getattr(Compressor, m)]
    if overridden:
        raise error(
            f"compression={value!r} overrides {'/'.join(overridden)}(), which hvd_trainer's "
            "allreduce never calls: it casts to the compressor's wire_dtype itself, after scaling, "
            "so that fp16 sums cannot overflow. HINT: subclass Compressor setting only name and "
            "wire_dtype (torch.float16 or torch.bfloat16), or use Compression.fp16 / .bf16."
        )
    if value.wire_dtype not in _WIRE_DTYPES:
        raise error(
            f"compression={value!r} has wire_dtype={value.wire_dtype}; the allreduce supports "
            "None, torch.float16 and torch.bfloat16. HINT: use Compression.fp16 or .bf16."
        )
    if not isinstance(value.name, str):
        raise error(f"compression={value!r} has name={value.name!r}; it must be a str (e.g. 'fp16').")


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

"""Flatten → one collective → unflatten: many tensors travel as one flat buffer per (device, dtype).

Broadcasting a model's state, a grouped allreduce and the Keras gradient/variable transport all
send a list of tensors as a few flat buffers instead of one collective per tensor:

1. the tensors are grouped by (device, dtype), groups in order of first appearance;
2. each group is concatenated, in list order, into one 1-D buffer (:func:`flatten`);
3. one collective runs on each buffer (the caller's function);
4. the buffer is split back into views shaped like the inputs (:meth:`FlatGroup.views`), which
   are returned or copied into the inputs (:func:`flat_collective_`).

One set of dtypes can travel, :data:`SUPPORTED_DTYPES`: every numeric dtype but float8, and
bool. Most travel as themselves; the few that gloo (or NCCL) has no collectives for travel in a
wider wire dtype, exactly (:data:`WIRE_DTYPES`, :func:`to_wire` / :func:`from_wire`): int16 and
uint16 as int32, uint32 as int64 (values converted, so sums of a few ranks cannot overflow the
wire), uint64 as int64 (the same 64 bits; for Min/Max the top bit is flipped so signed order is
unsigned order). Any other dtype (float8, the quantized ``qint8`` ...) is a
:class:`~hvd_trainer.comm.base.errors.CommTypeError` before anything is sent, whose hint says
what to send instead. numpy arrays (the Keras bridge) travel as themselves when their dtype
has a twin among the dtypes that travel as themselves, else as float32 (e.g.
``ml_dtypes.bfloat16``, ``int16``): see :func:`numpy_wire_dtype`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hvd_trainer.comm.base.errors import CommTypeError

__all__ = [
    "SUPPORTED_DTYPES",
    "WIRE_DTYPES",
    "wire_dtype",
    "to_wire",
    "from_wire",
    "FlatGroup",
    "check_dtype",
    "flatten",
    "flat_collective",
    "flat_collective_",
    "numpy_wire_dtype",
    "numpy_to_wire",
    "wire_to_numpy",
]

_NATIVE: frozenset[torch.dtype] = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
})
"""The dtypes every transport (gloo, NCCL) carries as themselves."""

WIRE_DTYPES: dict[torch.dtype, torch.dtype] = {
    torch.int16: torch.int32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
    torch.uint64: torch.int64,
}
"""dtype -> the dtype it travels as (exactly; see the module docstring), for the dtypes that
gloo or NCCL cannot carry."""

_BIT_VIEWS = frozenset({torch.uint64})  # same width as the wire: reinterpreted, not converted
_TOP_BIT = -(2**63)  # int64 with only the sign bit set

SUPPORTED_DTYPES: frozenset[torch.dtype] = _NATIVE | frozenset(WIRE_DTYPES)
"""The dtypes the collectives and a flattened group may have."""


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels as (itself unless it is in :data:`WIRE_DTYPES`)."""
    return WIRE_DTYPES.get(dtype, dtype)


def to_wire(tensor: torch.Tensor, op: str | None = None) -> torch.Tensor:
    """``tensor`` in its wire dtype: itself when it travels as itself, else a new contiguous
    tensor of the same shape (int16/uint16 -> int32, uint32 -> int64 by value; uint64 -> int64
    by bits, the top bit flipped when ``op`` is ``"min"`` or ``"max"``, so the signed order of
    the wire is the unsigned order of the values)."""
    if tensor.dtype not in WIRE_DTYPES:
        return tensor
    if tensor.dtype in _BIT_VIEWS:
        bits = tensor.contiguous().view(torch.int64).clone()
        return bits.bitwise_xor_(_TOP_BIT) if op in ("min", "max") else bits
    return tensor.to(WIRE_DTYPES[tensor.dtype], memory_format=torch.contiguous_format)


def from_wire(wire: torch.Tensor, dtype: torch.dtype, op: str | None = None) -> torch.Tensor:
    """Undo :func:`to_wire`: ``wire`` as a tensor of ``dtype`` (the same shape). Values out of
    ``dtype``'s range wrap (two's complement), as the native collective's sum would."""
    if wire.dtype == dtype:
        return wire
    if dtype in _BIT_VIEWS:
        bits = wire.bitwise_xor(_TOP_BIT) if op in ("min", "max") else wire
        return bits.contiguous().view(dtype)
    if dtype in (torch.uint16, torch.uint32):  # wrap as unsigned arithmetic does
        width = 16 if dtype == torch.uint16 else 32
        return torch.remainder(wire.to(torch.int64), 2**width).to(dtype)
    return wire.to(dtype)

Buffer = Callable[[torch.dtype, torch.device, int], torch.Tensor]
"""``buffer(dtype, device, numel)``: a 1-D tensor to flatten into (reused memory)."""


def check_dtype(dtype: torch.dtype, what: str) -> None:
    """Raise unless ``dtype`` is in :data:`SUPPORTED_DTYPES`.

    Raises:
        CommTypeError: naming ``what``, the dtype and the dtypes that can travel.
    """
    if dtype not in SUPPORTED_DTYPES:
        names = sorted(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise CommTypeError(
            f"{what}: dtype {dtype} cannot travel (the transports carry {names}). HINT: "
            f"{_conversion_hint(dtype)}"
        )


_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})
"""torch's quantized dtypes: integer values plus a scale and zero point (not plain numbers)."""


def _conversion_hint(dtype: torch.dtype) -> str:
    """What to send instead of a tensor of the unsupported ``dtype``."""
    if dtype in _QUANTIZED:
        return (f"{dtype} is a quantized dtype (integers with a scale and zero point, which a sum "
                "would not combine): send tensor.dequantize() (float32) and quantize the result "
                "again; to broadcast it as it is, send tensor.int_repr() (its integers) with "
                "tensor.q_scale() and tensor.q_zero_point().")
    if dtype.is_complex:
        return "convert the tensor first, tensor.to(torch.complex64), and back after."
    if dtype.is_floating_point:  # float8 and float4 variants
        return "convert the tensor first, tensor.float() (or .bfloat16()), and back after."
    return "convert the tensor first to a dtype above, e.g. tensor.to(torch.int32), and back after."


@dataclass(frozen=True, slots=True)
class FlatGroup:
    """Tensors of one (device, dtype) concatenated into one 1-D buffer.

    Attributes:
        indices: the positions of the group's tensors in the flattened list, in order.
        shapes: their shapes.
        flat: the buffer, ``sum(numel)`` elements of the group's dtype on its device.
    """

    indices: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    flat: torch.Tensor

    def views(self) -> list[torch.Tensor]:
        """The buffer split back into views shaped like the inputs (no copy)."""
        numels = [s.numel() for s in self.shapes]
        return [piece.view(shape) for piece, shape in zip(self.flat.split(numels), self.shapes, strict=True)]


def flatten(
    tensors: Sequence[torch.Tensor], *, what: str, buffer: Buffer | None = None
) -> list[FlatGroup]:
    """Group ``tensors`` by (device, dtype) and concatenate each group into one buffer.

    Args:
        tensors: any shapes (0-d included); the inputs are only read (detached).
        what: the caller, for error messages (e.g. ``"grouped_allreduce"``).
        buffer: where to flatten into (``buffer(dtype, device, numel)``); default: new memory.

    Returns:
        One :class:`FlatGroup` per (device, dtype), in order of first appearance.

    Raises:
        CommTypeError: a tensor's dtype is not in :data:`SUPPORTED_DTYPES`.
    """
    by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        by_key.setdefault((t.device, t.dtype), []).append(i)
    groups = []
    for (device, dtype), idx in by_key.items():
        check_dtype(dtype, what)
        parts = [tensors[i].detach().reshape(-1) for i in idx]
        if buffer is None:
            flat = torch.cat(parts)
        else:
            flat = torch.cat(parts, out=buffer(dtype, device, sum(p.numel() for p in parts)))
        groups.append(FlatGroup(tuple(idx), tuple(tensors[i].shape for i in idx), flat))
    return groups


def flat_collective(
    tensors: Sequence[torch.Tensor],
    collective: Callable[[torch.Tensor], Any],
    *,
    what: str,
    buffer: Buffer | None = None,
) -> list[torch.Tensor]:
    """Run ``collective(flat)`` (in place, blocking) on each flattened group.

    Returns:
        The results, in the order of ``tensors``: views into the flat buffers, shaped like the
        inputs and of their dtypes. The inputs are unchanged.

    Raises:
        CommTypeError: an unsupported dtype (before any collective runs).
    """
    groups = flatten(tensors, what=what, buffer=buffer)
    out: list[Any] = [None] * len(tensors)
    for group in groups:
        collective(group.flat)
        for i, view in zip(group.indices, group.views(), strict=True):
            out[i] = view
    return out


@torch.no_grad()  # writes into parameters in place
def flat_collective_(
    tensors: Sequence[torch.Tensor], collective: Callable[[torch.Tensor], Any], *, what: str
) -> None:
    """:func:`flat_collective`, with the results copied back into ``tensors`` (in place).

    Raises:
        CommTypeError: an unsupported dtype (before any collective runs).
    """
    results = flat_collective(tensors, collective, what=what)
    for t, result in zip(tensors, results, strict=True):
        t.copy_(result)


def _numpy_twin(dtype: torch.dtype) -> np.dtype | None:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # bfloat16 has no numpy dtype
        return None


_NUMPY_WIRE = frozenset(twin for d in _NATIVE if (twin := _numpy_twin(d)) is not None)


def numpy_wire_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype an array of ``dtype`` travels as: itself when its torch twin travels as
    itself (not widened), else float32 (e.g. ``ml_dtypes.bfloat16``, int16, uint32)."""
    dtype = np.dtype(dtype)
    return dtype if dtype in _NUMPY_WIRE else np.dtype("float32")


def numpy_to_wire(array: Any) -> tuple[torch.Tensor, np.dtype]:
    """A CPU tensor holding ``array`` in its wire dtype (:func:`numpy_wire_dtype`), and the
    array's own dtype to convert back to. Shares memory with ``array`` when it already is a
    C-contiguous, writeable array of its wire dtype; a 0-d array stays 0-d."""
    array = np.asarray(array)
    wire = np.asarray(array, dtype=numpy_wire_dtype(array.dtype))
    if not (wire.flags.c_contiguous and wire.flags.writeable):
        wire = wire.copy(order="C")
    return torch.from_numpy(wire), array.dtype


def wire_to_numpy(tensor: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    """``tensor`` (on the CPU) as a numpy array of ``dtype``, sharing memory when it can."""
    return tensor.numpy().astype(dtype, copy=False)

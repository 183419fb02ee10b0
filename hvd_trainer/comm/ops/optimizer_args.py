"""The argument checks shared by the torch and Keras ``DistributedOptimizer``.

Both wrappers take Horovod's ``op``, ``backward_passes_per_step`` and
``gradient_predivide_factor``; :func:`check_optimizer_args` validates them once, with one set
of messages, and each front end passes its own exception class.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from hvd_trainer.comm.base.errors import CommValueError
from hvd_trainer.comm.ops.ops import ReduceOp, reject_adasum, to_reduce_op

__all__ = [
    "OptimizerArgs",
    "OptimizerArgumentError",
    "check_optimizer_args",
    "check_backward_passes_per_step",
]


class OptimizerArgumentError(CommValueError):
    """An invalid ``op``, ``backward_passes_per_step`` or ``gradient_predivide_factor``."""


@dataclass(frozen=True, slots=True)
class OptimizerArgs:
    """Validated optimizer arguments."""

    op: ReduceOp
    """``ReduceOp.AVERAGE`` or ``ReduceOp.SUM``."""
    backward_passes_per_step: int
    """Backward passes accumulated locally per update, >= 1."""
    gradient_predivide_factor: float
    """``f > 0``: gradients are multiplied by ``1/f`` before the sum and ``f/size`` after it
    (``Average`` only; 1.0 otherwise)."""


def check_backward_passes_per_step(
    value: Any, *, error: type[Exception] = OptimizerArgumentError
) -> int:
    """Return ``value`` if it is an ``int >= 1`` (a ``bool`` is not: ``True`` is rejected).

    Raises:
        OptimizerArgumentError (or ``error``): anything else; the message echoes the value.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(
            f"backward_passes_per_step={value!r} must be an int >= 1. HINT: "
            "backward_passes_per_step=2 accumulates 2 backward passes locally per update."
        )
    return value


def _check_predivide(value: Any, rop: ReduceOp, error: type[Exception]) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise error(
            f"gradient_predivide_factor={value!r} must be > 0 (a real number). "
            "HINT: gradient_predivide_factor=1.0 (the default) divides after the sum only."
        )
    if value != 1.0 and rop is not ReduceOp.AVERAGE:
        raise error(
            f"gradient_predivide_factor={value!r} needs op=Average, got op={rop.name.title()}. "
            "HINT: leave gradient_predivide_factor=1.0 with op=Sum."
        )
    return float(value)


def check_optimizer_args(
    op: ReduceOp | str | None,
    backward_passes_per_step: Any,
    gradient_predivide_factor: Any,
    *,
    error: type[Exception] = OptimizerArgumentError,
    allow_adasum: bool = False,
) -> OptimizerArgs:
    """Validate the reduction arguments of a ``DistributedOptimizer``.

    Args:
        op: ``Average`` (also ``None``), ``Sum``, or a string / ``torch.distributed.ReduceOp``
            naming one of them.
        backward_passes_per_step: an ``int >= 1`` (not a ``bool``).
        gradient_predivide_factor: a real number ``> 0``; other than 1.0 only with ``Average``.
        error: the exception class to raise (the front end's own argument error).
        allow_adasum: the front end runs ``Adasum`` (the torch optimizer does).

    Returns:
        The normalised :class:`OptimizerArgs`.

    Raises:
        OptimizerArgumentError (or ``error``): an op other than Average/Sum (an unknown string
            included), a bad pass count or factor; the message echoes the value and gives a HINT.
        UnsupportedOpError: ``Adasum`` without ``allow_adasum``.
    """
    try:
        rop = to_reduce_op(op)
    except ValueError as exc:  # an unknown string or op: the front end's error, as documented
        raise error(f"op={op!r}: {exc} HINT: op=Average (the gradients' mean) or op=Sum.") from None
    if not allow_adasum:
        reject_adasum(rop, "this DistributedOptimizer")
    if rop not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM):
        raise error(
            f"op={op!r} is not supported by DistributedOptimizer (gradients are averaged or "
            "summed). HINT: use Average or Sum."
        )
    passes = check_backward_passes_per_step(backward_passes_per_step, error=error)
    factor = _check_predivide(gradient_predivide_factor, rop, error)
    return OptimizerArgs(op=rop, backward_passes_per_step=passes, gradient_predivide_factor=factor)

"""Reduction operators, with Horovod's public names (``Average``, ``Sum``, ``Min``, ``Max``,
``Product``, ``Adasum``) and the mapping from Lightning's strings and ``torch.distributed.ReduceOp``.

``Adasum`` runs in ``allreduce``/``grouped_allreduce`` (and their async and in-place forms)
and in the torch ``DistributedOptimizer`` (:mod:`hvd_trainer.comm.ops.adasum`); every other
reduction rejects it with :class:`UnsupportedOpError` (:func:`reject_adasum`).
"""

from __future__ import annotations

import enum
import warnings

import torch.distributed as dist

from hvd_trainer.comm.base.errors import CommValueError

__all__ = [
    "ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum", "to_reduce_op",
    "UnsupportedOpError", "reject_adasum",
]


class UnsupportedOpError(CommValueError, NotImplementedError):
    """A reduce op that a collective does not run (``Adasum`` outside allreduce and the torch
    optimizer). A ``ValueError`` and, like Horovod's errors for unsupported Adasum setups, a
    ``NotImplementedError``."""


class ReduceOp(enum.Enum):
    """How values from all ranks combine into one."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"

    @property
    def torch_op(self) -> dist.ReduceOp.RedOpType:
        """The transport op. ``AVERAGE`` is sent as ``SUM`` and divided (portable on gloo)."""
        return _TORCH_OPS[self]


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

_TORCH_OPS = {
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}

_STRINGS = {
    "mean": ReduceOp.AVERAGE,
    "avg": ReduceOp.AVERAGE,
    "average": ReduceOp.AVERAGE,
    "sum": ReduceOp.SUM,
    "min": ReduceOp.MIN,
    "max": ReduceOp.MAX,
    "product": ReduceOp.PRODUCT,
    "prod": ReduceOp.PRODUCT,
    "adasum": ReduceOp.ADASUM,
}


def to_reduce_op(op: ReduceOp | str | dist.ReduceOp | dist.ReduceOp.RedOpType | None) -> ReduceOp:
    """Normalise ``op`` (ours, a string such as ``"mean"``, or a ``torch.distributed.ReduceOp``).

    ``None`` means ``Average`` (Horovod's and Lightning's default); a bool is Horovod's older
    ``average`` flag (``True``: Average, ``False``: Sum).

    Raises:
        ValueError: an unknown string or op, naming the valid choices.
    """
    if op is None:
        return ReduceOp.AVERAGE
    if isinstance(op, bool):  # Horovod's second positional argument is ``average``
        return ReduceOp.AVERAGE if op else ReduceOp.SUM
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        key = op.lower()
        if key in _STRINGS:
            return _STRINGS[key]
        raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(_STRINGS)}.")
    torch_map = {
        dist.ReduceOp.SUM: ReduceOp.SUM,
        dist.ReduceOp.AVG: ReduceOp.AVERAGE,
        dist.ReduceOp.MIN: ReduceOp.MIN,
        dist.ReduceOp.MAX: ReduceOp.MAX,
        dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
    }
    for torch_op, ours in torch_map.items():
        if op == torch_op:
            return ours
    raise ValueError(
        f"unsupported reduce op {op!r}; expected Average, Sum, Min, Max, Product, a string "
        f"in {sorted(_STRINGS)} or the matching torch.distributed.ReduceOp."
    )


def reject_adasum(op: ReduceOp, where: str) -> ReduceOp:
    """Return ``op``; raise for ``Adasum`` in a collective that cannot run it.

    Raises:
        UnsupportedOpError: ``op`` is ``Adasum``.
    """
    if op is ReduceOp.ADASUM:
        raise UnsupportedOpError(
            f"op=Adasum is not supported by {where}. HINT: Adasum runs in hvd.allreduce, "
            "hvd.grouped_allreduce and the torch hvd.DistributedOptimizer(op=hvd.Adasum); here "
            "use op=hvd.Average (the usual gradient mean) or op=hvd.Sum."
        )
    return op


def op_or_average(op: ReduceOp | str | None, average: bool | None) -> ReduceOp | str | None:
    """Merge Horovod's older ``average=`` keyword into ``op``; ``average`` warns with a
    ``DeprecationWarning``, as Horovod does since 0.21 (it still works).

    Raises:
        ValueError: both were given.
    """
    if average is None:
        return op
    if op is not None:
        raise ValueError(
            f"got both average={average!r} and op={op!r}. HINT: pass only op= (average= is "
            "Horovod's older spelling: True means op=Average, False op=Sum)."
        )
    warnings.warn(
        f"average={average!r} is Horovod's older spelling of op=: use "
        f"op=hvd.{'Average' if average else 'Sum'} instead.",
        DeprecationWarning, stacklevel=3,
    )
    return ReduceOp.AVERAGE if average else ReduceOp.SUM

"""Reduction operators, with Horovod's public names (``Average``, ``Sum``, ``Min``, ``Max``,
``Product``) and the mapping from Lightning's strings and ``torch.distributed.ReduceOp``."""

from __future__ import annotations

import enum

import torch.distributed as dist

__all__ = ["ReduceOp", "Average", "Sum", "Min", "Max", "Product", "to_reduce_op"]


class ReduceOp(enum.Enum):
    """How values from all ranks combine into one."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"

    @property
    def torch_op(self) -> dist.ReduceOp.RedOpType:
        """The transport op. ``AVERAGE`` is sent as ``SUM`` and divided (portable on gloo)."""
        return _TORCH_OPS[self]


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

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
}


def to_reduce_op(op: ReduceOp | str | dist.ReduceOp | dist.ReduceOp.RedOpType | None) -> ReduceOp:
    """Normalise ``op`` (ours, a string such as ``"mean"``, or a ``torch.distributed.ReduceOp``).

    ``None`` means ``Average`` (Horovod's and Lightning's default).

    Raises:
        ValueError: an unknown string or op, naming the valid choices.
    """
    if op is None:
        return ReduceOp.AVERAGE
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

"""``zero_stage``: the one check of the argument, shared by every front end (the torch and Keras
``DistributedOptimizer``, ``HorovodStrategy``), so they accept and refuse the same values.

An int 0, 1 or 2 is accepted (numpy's integers too: anything with ``__index__``); a bool, float
or str is refused even when it names a stage (``True``, ``2.0``, ``"2"`` from a config file), with
a message that gives its type and the int to pass instead.
"""

from __future__ import annotations

import operator
from typing import Any

__all__ = ["ZERO_STAGES", "check_overlap_arg", "check_zero_stage"]

ZERO_STAGES = (0, 1, 2)
"""0: no sharding; 1: the optimizer state is sharded; 2: the averaged gradients are too."""

_MEANINGS = ("0 (no sharding), 1 (optimizer state sharded) or 2 (optimizer state and averaged "
             "gradients sharded)")


def check_zero_stage(value: Any, error: type[Exception]) -> int:
    """``value`` as the ZeRO stage, a plain int 0, 1 or 2.

    Example:
        >>> check_zero_stage(2, ValueError)
        2

    Args:
        value: what the user passed as ``zero_stage=``.
        error: the exception class to raise (the front end's argument error).

    Raises:
        error: ``value`` is not an int (a bool, float, str ...: the message names the type and,
            when the value names a stage, the int to pass), or an int other than 0, 1 and 2.
    """
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise error(f"zero_stage must be an int 0, 1 or 2, got the {type(value).__name__} {value!r}. "
                    f"HINT: {_hint_for(value)}")
    stage = operator.index(value)
    if stage not in ZERO_STAGES:
        hint = ("ZeRO stage 3 (sharded weights) is not implemented; use zero_stage=2." if stage == 3
                else "zero_stage=0, 1 or 2.")
        raise error(f"zero_stage={stage} must be {_MEANINGS}. HINT: {hint}")
    return stage


def _hint_for(value: Any) -> str:
    """``zero_stage=N`` when a non-int ``value`` spells stage N (``"2"``, ``2.0``), else the choices."""
    if isinstance(value, str):
        text = value.strip()
        named = int(text) if text.isdigit() else None
    elif isinstance(value, float) and value.is_integer():
        named = int(value)
    else:
        named = None
    if named in ZERO_STAGES:
        return f"zero_stage={named} (an int)."
    return f"zero_stage={_MEANINGS}."


def check_overlap_arg(zero_stage: int, overlap_exchange: Any, error: type[Exception]) -> None:
    """Refuse a ``zero_overlap_exchange`` that is not a bool, or ``True`` without ZeRO
    (``zero_stage`` already checked).

    Raises:
        error: naming the argument and what to pass instead.
    """
    if not isinstance(overlap_exchange, bool):
        raise error(f"zero_overlap_exchange={overlap_exchange!r} must be True or False.")
    if overlap_exchange and not zero_stage:
        raise error("zero_overlap_exchange=True needs zero_stage=1 or 2 (without ZeRO no "
                    "parameters are exchanged). HINT: pass zero_stage=1 or 2, or drop it.")

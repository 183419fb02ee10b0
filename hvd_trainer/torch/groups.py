"""``DistributedOptimizer(groups=..., num_groups=...)``: Horovod's explicit gradient groups.

A group is a list of parameters whose gradients are reduced together, as one grouped allreduce
(one collective per (device, dtype)) launched once every gradient of the group is ready; the
parameters in no group are bucketed by the optimizer's fusion config as without groups.
``groups`` is a list of lists of parameters, or an int ``k`` (the parameters, in registration
order, split into ``k`` contiguous groups as even as possible by count); ``num_groups=k`` is
Horovod's older spelling of ``groups=k``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["resolve_groups"]

Named = list[tuple[str, torch.Tensor]]


def _split(named: Named, k: int) -> list[Named]:
    base, extra = divmod(len(named), k)
    out, start = [], 0
    for i in range(k):
        stop = start + base + (1 if i < extra else 0)
        out.append(named[start:stop])
        start = stop
    return [g for g in out if g]


def resolve_groups(named: Named, num_groups: Any, groups: Any, error: type[Exception]) -> list[Named]:
    """The explicit groups of ``named`` (the trainable ``(name, param)``, in order); ``[]`` when
    neither argument asks for groups.

    Raises:
        error: ``num_groups``/``groups`` of the wrong type or negative; a parameter that is not
            trainable in the optimizer, or listed in two groups.
    """
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise error(f"num_groups={num_groups!r} must be an int >= 0. HINT: groups=k (or a list of "
                    "lists of parameters) is the current spelling.")
    if num_groups:
        warnings.warn("DistributedOptimizer(num_groups=k) is Horovod's older spelling; use groups=k.",
                      DeprecationWarning, stacklevel=4)
        if groups is None:
            groups = num_groups
    if groups is None or groups == 0:
        return []
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 0:
            raise error(f"groups={groups} must be >= 0.")
        return _split(named, groups)
    if not isinstance(groups, Sequence) or not all(isinstance(g, Sequence) for g in groups):
        raise error(f"groups must be an int or a list of lists of parameters, got {type(groups).__name__}. "
                    "HINT: groups=[[model.fc1.weight, model.fc1.bias], [model.fc2.weight]].")
    return _explicit(named, groups, error)


def _explicit(named: Named, groups: Sequence[Sequence[torch.Tensor]], error: type[Exception]) -> list[Named]:
    by_id = {id(p): (n, p) for n, p in named}
    position = {id(p): i for i, (_, p) in enumerate(named)}
    seen: set[int] = set()
    out: list[Named] = []
    for gi, group in enumerate(groups):
        members: Named = []
        for p in group:
            if id(p) not in by_id:
                raise error(f"groups[{gi}] holds a tensor that is not a trainable parameter of the "
                            "optimizer. HINT: list the optimizer's own parameters (requires_grad=True).")
            if id(p) in seen:
                raise error(f"parameter {by_id[id(p)][0]!r} is in two groups. HINT: each parameter "
                            "may be in at most one group.")
            seen.add(id(p))
            members.append(by_id[id(p)])
        if members:
            out.append(sorted(members, key=lambda m: position[id(m[1])]))
    return out

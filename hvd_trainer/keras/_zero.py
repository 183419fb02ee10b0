"""ZeRO stages 1 and 2 for the Keras ``DistributedOptimizer`` (torch backend).

The ownership plan and the parameter exchange are the comm layer's
(:func:`~hvd_trainer.comm.zero.plan_parameters`,
:func:`~hvd_trainer.comm.zero.exchange_parameters`), run on the torch tensors behind the Keras
variables (``variable.value``). What is Keras-specific lives here:

* the inner Keras optimizer is built on the owned variables only, so it creates slot variables
  (Adam's moments, SGD's momentum, ...) for them alone;
* :meth:`KerasZero.consolidate` gathers every rank's slot variables on one rank into a *shadow*
  optimizer: a plain optimizer of the inner one's class and config built on every variable, so
  its ``save_own_variables`` writes exactly what an unwrapped optimizer would;
* :meth:`KerasZero.load_full` reads such a full store and keeps this rank's part;
* :meth:`KerasZero.gather_all` gives every rank the full state by name (an elastic commit, which
  must load into a world of another size after an in-process re-form).

Slot variables are matched across optimizers by their Keras ``name`` (``add_variable_from_reference``
names them ``<variable path with "_" for "/">_<slot>``), which depends only on the model variable
and the slot, never on which optimizer instance built it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import torch.distributed as dist

from hvd_trainer.comm import ProcessSet, ShardPlan, exchange_parameters, plan_parameters
from hvd_trainer.keras._compat import iterations_variable

__all__ = ["KerasZero", "replicated", "slot_variables", "state_bytes"]


def replicated(optimizer: Any) -> list[Any]:
    """The variables every rank holds the same value of: ``iterations`` and the learning-rate
    variable (absent with a schedule)."""
    out = [iterations_variable(optimizer)]
    lr = optimizer.learning_rate  # the variable itself, unless a schedule or callable computes it
    if isinstance(lr, keras.Variable) and any(lr is v for v in optimizer.variables):
        out.append(lr)
    return out


def slot_variables(optimizer: Any) -> list[Any]:
    """``optimizer.variables`` without ``iterations`` and the learning rate (the per-variable
    state: moments, momentum, accumulators)."""
    skip = {id(v) for v in replicated(optimizer)}
    return [v for v in optimizer.variables if id(v) not in skip]


def state_bytes(optimizer: Any) -> int:
    """Bytes of :func:`slot_variables` (``size * itemsize`` summed)."""
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in slot_variables(optimizer))


def _local_slots(inner: Any) -> dict[str, np.ndarray]:
    """This rank's slot variables by Keras ``name``, as numpy copies."""
    return {v.name: np.array(keras.ops.convert_to_numpy(v)) for v in slot_variables(inner)}


def _merged(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The ranks' slot variables in one dict by name.

    Raises:
        ValueError: two ranks hold a variable of the same name.
    """
    merged: dict[str, np.ndarray] = {}
    for part in parts:
        clash = sorted(set(merged) & set(part))
        if clash:
            raise ValueError(f"ZeRO: slot variable names {clash[:3]} come from two ranks (model "
                             "variables with the same path?).")
        merged.update(part)
    return merged


class KerasZero:
    """Ownership of the sharded variables and the ZeRO step / checkpoint logic.

    A plain object (not tracked by Keras, so the saver never walks into it).

    Args:
        stage: 1 or 2.
        variables: the sharded variables (trainable, not local), in the optimizer's variable
            order (the same on every rank).
        pset: the ranks they are sharded over (this rank is a member; size > 1).
        plan: stage 2: the plan of the reduce-scatter reducer (so gradients arrive where they
            are stepped); ``None``: planned here on the default buckets.
    """

    def __init__(self, stage: int, variables: Sequence[Any], pset: ProcessSet,
                 plan: ShardPlan | None = None) -> None:
        self.stage = stage
        self.pset = pset
        self.variables = list(variables)
        named = [(f"{i}:{v.path}", v.value) for i, v in enumerate(self.variables)]
        self.plan = plan if plan is not None else plan_parameters(named, None, pset.size())
        self.rank = pset.rank()
        self._owned = {id(self.variables[i]) for i in self.plan.owned(self.rank)}
        self._sharded = {id(v) for v in self.variables}
        self._buckets = [
            (shard, [named[i][1] for i in shard.params],
             f"keras:{named[shard.params[0]][0]}..{named[shard.params[-1]][0]}")
            for shard in self.plan.buckets if shard.params
        ]
        self.consolidated: Any = None
        """The shadow optimizer holding the full state (rank ``to`` after :meth:`consolidate`)."""

    def owns(self, variable: Any) -> bool:
        """Whether this rank steps ``variable`` (variables outside the plan: always)."""
        return id(variable) in self._owned or id(variable) not in self._sharded

    def exchange(self) -> None:
        """Copy every sharded variable's value from its owner (a collective)."""
        exchange_parameters(self._buckets, pset=self.pset)

    # -- checkpoints -----------------------------------------------------------------------
    def _shadow(self, inner: Any, var_list: Sequence[Any]) -> Any:
        shadow = type(inner).from_config(inner.get_config())
        shadow.build(list(var_list))
        return shadow

    def consolidate(self, inner: Any, var_list: Sequence[Any], to: int) -> None:
        """Gather the slot variables of every rank into a full shadow optimizer on rank ``to``
        of the set (a collective: every member calls it)."""
        self.consolidated = None
        if not 0 <= to < self.pset.size():
            raise ValueError(f"to={to} is not a rank of the process set (size {self.pset.size()}).")
        local = _local_slots(inner)
        me = self.pset.rank()
        gathered: list[Any] | None = [None] * self.pset.size() if me == to else None
        dist.gather_object(local, gathered, dst=self.pset.ranks[to], group=self.pset.cpu_group)
        if me != to:
            return
        assert gathered is not None
        merged = _merged(gathered)
        shadow = self._shadow(inner, var_list)
        self._fill(shadow, inner, merged)
        self.consolidated = shadow

    def gather_all(self, inner: Any) -> dict[str, np.ndarray]:
        """Every rank's slot variables and the replicated ones, by Keras ``name``, on every rank
        of the set (a collective: every member calls it). What an unwrapped optimizer of the
        inner class would hold, whatever the world it is loaded into later."""
        local = _local_slots(inner)
        gathered: list[Any] = [None] * self.pset.size()
        dist.all_gather_object(gathered, local, group=self.pset.cpu_group)
        merged = _merged(gathered)
        for v in replicated(inner):
            merged[v.name] = np.array(keras.ops.convert_to_numpy(v))
        return merged

    @staticmethod
    def _fill(target: Any, source: Any, slots: dict[str, np.ndarray]) -> None:
        """Assign ``target``'s replicated variables from ``source`` and its slots from ``slots``
        (by name)."""
        for t, s in zip(replicated(target), replicated(source), strict=True):
            t.assign(s)
        for v in slot_variables(target):
            if v.name not in slots:
                raise ValueError(f"ZeRO: no rank holds the optimizer variable {v.name!r} "
                                 f"({type(source).__name__} names its state differently).")
            v.assign(slots[v.name])

    def load_full(self, inner: Any, var_list: Sequence[Any], store: Any) -> None:
        """Load a full (unsharded) optimizer store and keep this rank's part in ``inner``."""
        shadow = self._shadow(inner, var_list)
        if len(store.keys()) != len(shadow.variables):
            raise ValueError(
                f"the saved optimizer state has {len(store.keys())} variables, a full "
                f"{type(inner).__name__} for this model has {len(shadow.variables)}: it was not "
                "saved from this model's optimizer (or was saved partial)."
            )
        shadow.load_own_variables(store)
        for t, s in zip(replicated(inner), replicated(shadow), strict=True):
            t.assign(s)
        full = {v.name: v for v in slot_variables(shadow)}
        for v in slot_variables(inner):
            v.assign(full[v.name])
        self.consolidated = None

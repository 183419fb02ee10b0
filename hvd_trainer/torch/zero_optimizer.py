"""ZeRO in the torch ``DistributedOptimizer``: the wiring of
:class:`~hvd_trainer.comm.zero.ZeroSharding` (the algorithm lives in :mod:`hvd_trainer.comm.zero`).

Usage (Horovod's loop; only ``zero_stage`` and the clipping call are new)::

    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(), zero_stage=2)
    loss.backward()
    opt.synchronize()
    opt.clip_grad_norm_(1.0)          # global norm over every rank's shard
    with opt.skip_synchronize():
        opt.step()                    # steps the owned parameters, then exchanges them

    opt.consolidate_state_dict(to=0)  # every rank; then on rank 0:
    if hvd.rank() == 0:
        torch.save(opt.state_dict(), "opt.pt")   # a plain torch optimizer loads it
    opt.load_state_dict(torch.load("opt.pt"))    # every rank, any world size: resharded

What stays as without ZeRO: ``backward_passes_per_step`` (passes before the synchronising one
accumulate full local gradients), ``op=Average/Sum``, ``gradient_predivide_factor``, process
sets (ranks outside the set step everything locally, as their reducer does nothing), LR
schedulers (they write the inner optimizer's ``param_groups``), ``GradScaler`` (stage 2 makes
every rank see an inf/NaN found in any shard, so all skip the same step). Not supported:
``op=Adasum``, ``groups``, ``add_param_group`` after wrapping, sparse gradients in stage 2
(use ``sparse_as_dense=True``), ``Compression.fp16`` in stage 2 (``bf16`` works), ``join``
(the parameter exchange is not an allreduce a joined rank can take part in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hvd_trainer.comm import ZeroSharding, init_optimizer_bookkeeping

__all__ = ["ZeroStep"]


class ZeroStep(torch.optim.Optimizer):
    """A view of ``optimizer`` whose ``step`` is ZeRO's: for a front end that keeps the user's
    optimizer unwrapped (the Lightning strategy hands this to its precision plugin for one step).

    ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's (shared, not copied);
    ``step(closure)`` runs the closure, steps the owned parameters and exchanges the updated
    ones (:meth:`ZeroSharding.step`). ``GradScaler`` unscales through ``param_groups``.

    Args:
        optimizer: the user's optimizer.
        sharding: its :class:`ZeroSharding`.
    """

    _step_supports_amp_scaling = False  # GradScaler unscales param_groups first (as for ours)

    def __init__(self, optimizer: torch.optim.Optimizer, sharding: ZeroSharding) -> None:
        self._inner = optimizer
        self._sharding = sharding
        init_optimizer_bookkeeping(self)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._inner.defaults

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        return self._sharding.step(self._inner, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._sharding.restore_param_groups()
        self._inner.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"ZeroStep({self._inner!r}, stage={self._sharding.stage})"

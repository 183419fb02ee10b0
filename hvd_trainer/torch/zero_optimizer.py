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

from hvd_trainer.comm import ZeroSharding, init_optimizer_bookkeeping, stage2_config

__all__ = ["ZeroStep", "make_sharding"]


def make_sharding(opt: Any, zero_stage: int, *, overlap_exchange: bool = False) -> ZeroSharding | None:
    """The :class:`ZeroSharding` of the ``DistributedOptimizer`` ``opt`` (``None`` for stage 0).
    ``zero_stage`` and its combination with the other options were checked by
    :class:`~hvd_trainer.comm.sync_options.SyncOptions`.

    Raises:
        UnshardableOptimizerError: the inner optimizer's step is not per parameter.
    """
    if zero_stage == 0:
        return None
    if zero_stage == 2:
        # Bucket caps paced to the link now (a collective over the set on several hosts), so
        # the ownership planned here is the one the stage-2 reducer plans at the first step.
        device = next((p.device for _, p in opt._named), None)
        opt._sync.fusion, _ = stage2_config(opt._sync.fusion, opt._world, opt._process_set, device)
    return ZeroSharding(opt._named, opt._inner, stage=zero_stage, world=opt._world,
                        config=opt._sync.fusion, process_set=opt._process_set,
                        overlap_exchange=overlap_exchange)


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

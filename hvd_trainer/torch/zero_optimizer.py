"""ZeRO in the torch ``DistributedOptimizer``: argument checks and the wiring of
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

from hvd_trainer.comm import ReduceOp
from hvd_trainer.comm.base._torch_compat import init_optimizer_bookkeeping
from hvd_trainer.comm.zero import ShardedGradientReducer, ZeroSharding, check_zero_stage
from hvd_trainer.comm.zero.reducer import stage2_config

__all__ = ["ZeroStep", "make_sharding", "check_overlap_arg", "check_same_plan"]


def make_sharding(opt: Any, zero_stage: Any, error: type[Exception], *,
                  overlap_exchange: bool = False) -> ZeroSharding | None:
    """The :class:`ZeroSharding` of the ``DistributedOptimizer`` ``opt`` (``None`` for stage 0).

    Raises:
        error: ``zero_stage`` not an int 0, 1 or 2 (:func:`~hvd_trainer.comm.zero.check_zero_stage`;
            ``True`` and ``"2"`` included), or combined with an option
            ZeRO does not support (named in the message).
        UnshardableOptimizerError: the inner optimizer's step is not per parameter.
    """
    zero_stage = check_zero_stage(zero_stage, error)
    check_overlap_arg(zero_stage, overlap_exchange, error)
    if zero_stage == 0:
        return None
    if opt._op is ReduceOp.ADASUM:
        raise error(f"zero_stage={zero_stage} with op=Adasum: Adasum combines whole weight "
                    "changes on every rank. HINT: use op=Average with ZeRO.")
    if opt._groups:
        raise error(f"zero_stage={zero_stage} with groups: the shard plan follows the fused "
                    "buckets. HINT: drop groups=/num_groups= with ZeRO.")
    if getattr(opt, "_auto_compression", False):
        raise error(f"zero_stage={zero_stage} with compression='auto': auto may choose PowerSGD, "
                    "whose error feedback keeps per-rank residuals of whole gradients, which ZeRO "
                    "does not hold. HINT: use compression='none' or 'bf16' with ZeRO.")
    if opt._compression.error_feedback:
        raise error(f"zero_stage={zero_stage} with compression={opt._compression.name}: error "
                    "feedback keeps per-rank residuals of whole gradients, which ZeRO does not "
                    "hold. HINT: use compression='none' or 'bf16' with ZeRO.")
    if zero_stage == 2 and getattr(opt._compression, "needs_global_scale", False):
        raise error(f"zero_stage=2 with compression={opt._compression.name}: the fp16 global "
                    "scale is not applied to reduce-scatter. HINT: use Compression.bf16.")
    if zero_stage == 2:
        # Bucket caps paced to the link now (a collective over the set on several hosts), so
        # the ownership planned here is the one the stage-2 reducer plans at the first step.
        device = next((p.device for _, p in opt._named), None)
        opt._fusion_config, _ = stage2_config(opt._fusion_config, opt._world, opt._process_set, device)
    return ZeroSharding(opt._named, opt._inner, stage=zero_stage, world=opt._world,
                        config=opt._fusion_config, process_set=opt._process_set,
                        overlap_exchange=overlap_exchange)


def check_overlap_arg(zero_stage: Any, overlap_exchange: Any, error: type[Exception]) -> None:
    """Refuse a ``zero_overlap_exchange`` that is not a bool, or ``True`` without ZeRO.

    Raises:
        error: naming the argument and what to pass instead.
    """
    if not isinstance(overlap_exchange, bool):
        raise error(f"zero_overlap_exchange={overlap_exchange!r} must be True or False.")
    if overlap_exchange and not zero_stage:
        raise error("zero_overlap_exchange=True needs zero_stage=1 or 2 (without ZeRO no "
                    "parameters are exchanged). HINT: pass zero_stage=1 or 2, or drop it.")


def check_same_plan(reducer: ShardedGradientReducer, sharding: ZeroSharding) -> None:
    """Internal invariant: the stage-2 reducer scatters to the owners the optimizer steps."""
    assert reducer.plan.owner == sharding.plan.owner, "ZeRO: reducer and optimizer plans differ"


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
        self._inner.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"ZeroStep({self._inner!r}, stage={self._sharding.stage})"

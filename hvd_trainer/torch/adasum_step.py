"""The optimizer step of ``DistributedOptimizer(op=hvd.Adasum)``, with Horovod's semantics.

Horovod's Adasum optimizer does not combine gradients: every rank applies its *own* gradient
with the wrapped optimizer (momentum, Adam moments and all), and the resulting weight changes
``delta_r = w_after_r - w_before`` are combined with Adasum (:mod:`hvd_trainer.comm.ops.adasum`,
Maleki et al. 2021, arXiv:2006.02924); each rank then sets ``w = w_before + adasum(delta)``, so
the weights stay identical on every rank. The deltas are combined per parameter (each tensor
with its own dot products), in one grouped Adasum per dtype. Optimizer *state* (momentum
buffers, Adam moments) stays local, as in Horovod.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hvd_trainer.comm import Adasum, Compressor, World, grouped_allreduce_

__all__ = ["adasum_step"]


def adasum_step(
    inner: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    *,
    compression: Compressor,
    process_set: Any,
    world: World,
) -> Any:
    """Step ``inner`` on the local gradients, then replace each parameter's change by the
    Adasum of every rank's change. Returns what ``inner.step()`` returned.

    Args:
        inner: the wrapped optimizer.
        params: the trainable parameters, in the same order on every rank.

    Raises:
        CommTypeError: a parameter that is not floating point (Adasum needs dot products).
    """
    with torch.no_grad():
        before = [p.detach().clone() for p in params]
    result = inner.step()
    if not params:
        return result
    with torch.no_grad():
        deltas = [p.detach() - b for p, b in zip(params, before, strict=True)]
        grouped_allreduce_(deltas, name="adasum.weight_delta", op=Adasum, process_set=process_set,
                           compression=compression, world=world)
        for p, b, d in zip(params, before, deltas, strict=True):
            p.copy_(b.add_(d))
    return result

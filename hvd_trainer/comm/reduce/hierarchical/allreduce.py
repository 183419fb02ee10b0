"""The three phases of a hierarchical allreduce, and the work handle that runs them off-thread."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hvd_trainer.comm.base.future_work import FutureWork
from hvd_trainer.comm.reduce.hierarchical.topology import HostTopology

__all__ = ["HierarchicalWork", "hierarchical_allreduce_"]


@torch.no_grad()
def hierarchical_allreduce_(wire: torch.Tensor, op: dist.ReduceOp, topo: HostTopology) -> None:
    """Allreduce the contiguous ``wire`` in place over every rank of ``topo``'s hosts.

    1. reduce-scatter ``wire`` (padded to a multiple of L elements) inside the host: local rank
       ``i`` holds the host's reduction of slice ``i``;
    2. allreduce that slice across hosts (the only traffic on the hosts' ports);
    3. allgather the slices inside the host, then copy the result into ``wire``.

    Same result as a flat allreduce up to summation order (float sums are not associative).
    """
    flat = wire.reshape(-1)
    n, size = flat.numel(), topo.local_size
    chunk = -(-n // size)
    padded = F.pad(flat, (0, chunk * size - n)) if chunk * size != n else flat
    mine = torch.empty(chunk, dtype=wire.dtype, device=wire.device)
    dist.reduce_scatter_tensor(mine, padded, op=op, group=topo.local_group)
    dist.all_reduce(mine, op=op, group=topo.cross_group)
    gathered = padded if padded is not flat else torch.empty_like(padded)
    dist.all_gather_into_tensor(gathered, mine, group=topo.local_group)
    if gathered is not flat:
        flat.copy_(gathered[:n])


class HierarchicalWork(FutureWork):
    """A ``torch.distributed`` ``Work``-like handle of one hierarchical allreduce in flight on the
    topology's worker thread (see :class:`~hvd_trainer.comm.base.future_work.FutureWork`)."""

    def __init__(self, wire: torch.Tensor, op: dist.ReduceOp, topo: HostTopology) -> None:
        super().__init__(topo.executor.submit(hierarchical_allreduce_, wire, op, topo),
                         "hierarchical allreduce")

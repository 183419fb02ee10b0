"""Differentiable collectives: the backward passes Horovod's torch API defines.

``allreduce``, ``allgather`` and ``broadcast`` route here when their input requires grad and
grad mode is on, so losses built on gathered or reduced tensors (contrastive losses over the
global batch, for instance) train as they do with ``horovod.torch``:

* allreduce: the gradient is allreduced with the same op and scale factors (Average or Sum;
  Min/Max/Product have no gradient here and raise in backward);
* allgather: the gradient of the concatenation is averaged over the set and each rank keeps
  the rows it contributed;
* broadcast: the gradient is averaged over the set; the root keeps it, other ranks get zeros.
"""

from __future__ import annotations

from typing import Any

import torch

from hvd_trainer.comm.errors import CommError
from hvd_trainer.comm.ops import ReduceOp, to_reduce_op

__all__ = ["needs_autograd", "allreduce_with_grad", "allgather_with_grad", "broadcast_with_grad"]


def needs_autograd(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` takes part in a graph that backward will traverse."""
    return tensor.requires_grad and torch.is_grad_enabled()


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float,
                pset: Any, world: Any) -> torch.Tensor:
        from hvd_trainer.comm.collectives import allreduce

        ctx.args = (op, pre, post, pset, world)
        return allreduce(tensor, op, None, pre, post, process_set=pset, world=world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        from hvd_trainer.comm.collectives import allreduce

        op, pre, post, pset, world = ctx.args
        if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise CommError(
                f"allreduce with op={op.name} has no gradient. HINT: use Average or Sum in a "
                "differentiable computation, or detach() the input."
            )
        out = allreduce(grad.contiguous(), op, None, pre, post, process_set=pset, world=world)
        return out, None, None, None, None, None


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, pset: Any, world: Any) -> torch.Tensor:
        from hvd_trainer.comm.movement import allgather

        ctx.rows = tensor.shape[0] if tensor.dim() > 0 else 1
        ctx.args = (pset, world)
        return allgather(tensor, None, pset, world=world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        from hvd_trainer.comm.collectives import allreduce
        from hvd_trainer.comm.movement import allgather
        from hvd_trainer.comm.process_set import resolve_set

        pset, world = ctx.args
        reduced = allreduce(grad.contiguous(), ReduceOp.AVERAGE, None, process_set=pset, world=world)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64), None, pset, world=world)
        member = resolve_set(pset, world, "allgather").rank()
        offset = int(rows[:member].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, pset: Any, world: Any) -> torch.Tensor:
        from hvd_trainer.comm.movement import broadcast

        ctx.args = (root_rank, pset, world)
        return broadcast(tensor, root_rank, None, pset, world=world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        from hvd_trainer.comm.collectives import allreduce
        from hvd_trainer.comm.world import get_world

        root_rank, pset, world = ctx.args
        reduced = allreduce(grad.contiguous(), ReduceOp.AVERAGE, None, process_set=pset, world=world)
        rank = (world or get_world()).rank
        if rank != root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def allreduce_with_grad(tensor: torch.Tensor, op: Any, pre: float, post: float, pset: Any,
                        world: Any) -> torch.Tensor:
    """Differentiable allreduce (no compression on this path)."""
    return _Allreduce.apply(tensor, to_reduce_op(op), pre, post, pset, world)


def allgather_with_grad(tensor: torch.Tensor, pset: Any, world: Any) -> torch.Tensor:
    """Differentiable allgather."""
    return _Allgather.apply(tensor, pset, world)


def broadcast_with_grad(tensor: torch.Tensor, root_rank: int, pset: Any, world: Any) -> torch.Tensor:
    """Differentiable broadcast."""
    return _Broadcast.apply(tensor, root_rank, pset, world)

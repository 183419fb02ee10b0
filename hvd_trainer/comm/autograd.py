"""Differentiable collectives: the backward passes Horovod's torch API defines.

``allreduce``, ``allgather`` and ``broadcast`` route here when their input requires grad and
grad mode is on, so losses built on gathered or reduced tensors (contrastive losses over the
global batch, for instance) train as they do with ``horovod.torch``:

* allreduce: the gradient is allreduced with the same op and scale factors (Average or Sum;
  Min/Max/Product have no gradient here and raise in backward);
* allgather: the gradient of the concatenation is averaged over the set and each rank keeps
  the rows it contributed;
* broadcast: the gradient is averaged over the set; the root keeps it, other ranks get zeros.

Forward and backward run the asynchronous forms (:mod:`~hvd_trainer.comm.reductions_async`,
:mod:`~hvd_trainer.comm.movement_async`) and wait; a gradient that itself requires grad (double
backward, ``create_graph=True``) is allreduced differentiably again.
"""

from __future__ import annotations

from typing import Any

import torch

from hvd_trainer.comm.errors import CommError
from hvd_trainer.comm.movement_async import allgather_async, broadcast_async
from hvd_trainer.comm.ops import ReduceOp, to_reduce_op
from hvd_trainer.comm.process_set import resolve_set
from hvd_trainer.comm.reductions_async import allreduce_async
from hvd_trainer.comm.world import get_world

__all__ = ["needs_autograd", "allreduce_with_grad", "allgather_with_grad", "broadcast_with_grad"]


def needs_autograd(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` takes part in a graph that backward will traverse."""
    return tensor.requires_grad and torch.is_grad_enabled()


def _allreduce(tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, pset: Any,
               world: Any) -> torch.Tensor:
    """The blocking allreduce of a gradient: differentiable when it requires grad."""
    if needs_autograd(tensor):
        return _Allreduce.apply(tensor, op, pre, post, pset, world)
    return allreduce_async(tensor, op, None, pre, post, process_set=pset, world=world).wait()


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float,
                pset: Any, world: Any) -> torch.Tensor:
        ctx.args = (op, pre, post, pset, world)
        return allreduce_async(tensor, op, None, pre, post, process_set=pset, world=world).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, pre, post, pset, world = ctx.args
        if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise CommError(
                f"allreduce with op={op.name} has no gradient. HINT: use Average or Sum in a "
                "differentiable computation, or detach() the input."
            )
        out = _allreduce(grad.contiguous(), op, pre, post, pset, world)
        return out, None, None, None, None, None


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, pset: Any, world: Any) -> torch.Tensor:
        ctx.rows = tensor.shape[0] if tensor.dim() > 0 else 1
        ctx.args = (pset, world)
        return allgather_async(tensor, None, pset, world=world).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        pset, world = ctx.args
        reduced = _allreduce(grad.contiguous(), ReduceOp.AVERAGE, 1.0, 1.0, pset, world)
        rows = allgather_async(torch.tensor([ctx.rows], dtype=torch.int64), None, pset, world=world).wait()
        member = resolve_set(pset, world, "allgather").rank()
        offset = int(rows[:member].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, pset: Any, world: Any) -> torch.Tensor:
        ctx.args = (root_rank, pset, world)
        return broadcast_async(tensor, root_rank, None, pset, world=world).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        root_rank, pset, world = ctx.args
        reduced = _allreduce(grad.contiguous(), ReduceOp.AVERAGE, 1.0, 1.0, pset, world)
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

"""Differentiable collectives: the backward passes Horovod's torch API defines.

Every blocking collective that carries floating values routes here when an input requires
grad and grad mode is on, so losses built on gathered or reduced tensors (contrastive losses
over the global batch, for instance) train as they do with ``horovod.torch``:

* allreduce, grouped_allreduce: the gradient is allreduced with the same op and scale factors
  (Average or Sum; Min/Max/Product have no gradient here and raise in backward);
* allgather, grouped_allgather: the gradient of the concatenation is averaged over the set and
  each rank keeps the rows it contributed;
* broadcast: the gradient is averaged over the set; the root keeps it, other ranks get zeros;
* alltoall: the gradient travels back the way the rows came (an alltoall of the gradient with
  the received splits), so each rank gets the gradient of the rows it sent;
* reducescatter, grouped_reducescatter: the gradients of every member's block are allgathered
  (the adjoint of reduce-then-slice), times ``prescale_factor * postscale_factor``, divided by
  the set size for Average (as the allreduce rule above gives for the reduced tensor);
  ``HVD_TRAINER_REDUCESCATTER_GRAD=horovod`` multiplies that by the set size, Horovod's scale
  (:func:`~hvd_trainer.comm.base.config.reducescatter_grad_horovod`).

All of these also hold inside a process set (the backward runs on the same set).

Forward and backward run the asynchronous forms (:mod:`~hvd_trainer.comm.ops.reductions_async`,
:mod:`~hvd_trainer.comm.ops.movement_async`) and wait; a gradient that itself requires grad (double
backward, ``create_graph=True``) is allreduced differentiably again.
"""

from __future__ import annotations

from typing import Any

import torch

from hvd_trainer.comm.base.config import reducescatter_grad_horovod
from hvd_trainer.comm.base.errors import CommError
from hvd_trainer.comm.ops.movement_async import (
    allgather_async,
    alltoall_async,
    broadcast_async,
    grouped_allgather_async,
)
from hvd_trainer.comm.ops.ops import ReduceOp, reject_adasum, to_reduce_op
from hvd_trainer.comm.ops.process_set import resolve_set
from hvd_trainer.comm.ops.reductions_async import (
    allreduce_async,
    grouped_allreduce_async,
    grouped_reducescatter_async,
    reducescatter_async,
)
from hvd_trainer.comm.world.world import get_world

__all__ = [
    "needs_autograd", "any_needs_autograd", "allreduce_with_grad", "allgather_with_grad",
    "broadcast_with_grad", "grouped_allreduce_with_grad", "grouped_allgather_with_grad",
    "alltoall_with_grad", "reducescatter_with_grad", "grouped_reducescatter_with_grad",
]


def needs_autograd(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` takes part in a graph that backward will traverse."""
    return tensor.requires_grad and torch.is_grad_enabled()


def any_needs_autograd(tensors: Any) -> bool:
    """True when any tensor of the list needs autograd (see :func:`needs_autograd`)."""
    return any(isinstance(t, torch.Tensor) and needs_autograd(t) for t in tensors)


def _require_linear(op: ReduceOp, what: str) -> None:
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise CommError(
            f"{what} with op={op.name} has no gradient. HINT: use Average or Sum in a "
            "differentiable computation, or detach() the input."
        )


def _allreduce(tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, pset: Any,
               world: Any) -> torch.Tensor:
    """The blocking allreduce of a gradient: differentiable when it requires grad."""
    if needs_autograd(tensor):
        return _Allreduce.apply(tensor, op, pre, post, pset, world)
    return allreduce_async(tensor, op=op, prescale_factor=pre, postscale_factor=post,
                           process_set=pset, world=world).wait()


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float,
                pset: Any, world: Any) -> torch.Tensor:
        ctx.args = (op, pre, post, pset, world)
        return allreduce_async(tensor, op=op, prescale_factor=pre, postscale_factor=post,
                               process_set=pset, world=world).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, pre, post, pset, world = ctx.args
        _require_linear(op, "allreduce")
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
        return _allgather_grad(grad, ctx.rows, pset, world), None, None


def _allgather_grad(grad: torch.Tensor, rows: int, pset: Any, world: Any) -> torch.Tensor:
    """This member's rows of the set's average of ``grad`` (the gradient of a concatenation)."""
    reduced = _allreduce(grad.contiguous(), ReduceOp.AVERAGE, 1.0, 1.0, pset, world)
    counts = allgather_async(torch.tensor([rows], dtype=torch.int64), None, pset, world=world).wait()
    member = resolve_set(pset, world, "allgather").rank()
    return reduced.narrow(0, int(counts[:member].sum()), rows)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, pset: Any, world: Any, *tensors: torch.Tensor) -> tuple:
        ctx.rows = [t.shape[0] if t.dim() > 0 else 1 for t in tensors]
        ctx.args = (pset, world)
        return tuple(grouped_allgather_async(list(tensors), name, pset, world=world).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        pset, world = ctx.args
        return (None, None, None,
                *(_allgather_grad(g, rows, pset, world) for g, rows in zip(grads, ctx.rows, strict=True)))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: ReduceOp, pre: float, post: float, name: Any, pset: Any, world: Any,
                *tensors: torch.Tensor) -> tuple:
        ctx.args = (op, pre, post, pset, world)
        out = grouped_allreduce_async(list(tensors), None, name, op, pre, post, pset, world=world).wait()
        return tuple(t.clone() for t in out)  # own storage each: views of one buffer cannot be edited

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, pre, post, pset, world = ctx.args
        _require_linear(op, "grouped_allreduce")
        grads = tuple(g.contiguous() for g in grads)
        if any_needs_autograd(grads):
            reduced = _GroupedAllreduce.apply(op, pre, post, None, pset, world, *grads)
        else:
            reduced = grouped_allreduce_async(list(grads), None, None, op, pre, post, pset,
                                              world=world).wait()
        return (None,) * 6 + tuple(reduced)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any, pset: Any,
                world: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = alltoall_async(tensor, splits, name, pset, world=world).wait()
        ctx.args = (received, pset, world)
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_splits: Any) -> tuple:
        received, pset, world = ctx.args
        back, _ = alltoall_async(grad.contiguous(), received, None, pset, world=world).wait()
        return back, None, None, None, None


def _scatter_scale(op: ReduceOp, pre: float, post: float, pset: Any, world: Any) -> float:
    """The factor on the allgathered output gradients: the exact adjoint's, or with
    ``HVD_TRAINER_REDUCESCATTER_GRAD=horovod`` the set size times it (Horovod's)."""
    _require_linear(op, "reducescatter")
    scale = pre * post
    size = resolve_set(pset, world, "reducescatter").size()
    if op is ReduceOp.AVERAGE:
        scale /= size
    return scale * size if reducescatter_grad_horovod() else scale


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, name: Any,
                pset: Any, world: Any) -> torch.Tensor:
        ctx.args = (op, pre, post, pset, world)
        return reducescatter_async(tensor, name, op, pset, pre, post, world=world).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, pre, post, pset, world = ctx.args
        scale = _scatter_scale(op, pre, post, pset, world)
        full = allgather_async(grad.contiguous(), None, pset, world=world).wait()
        return full * scale, None, None, None, None, None, None


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: ReduceOp, pre: float, post: float, name: Any, pset: Any, world: Any,
                *tensors: torch.Tensor) -> tuple:
        ctx.args = (op, pre, post, pset, world)
        return tuple(grouped_reducescatter_async(list(tensors), name, op, pset, pre, post,
                                                 world=world).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, pre, post, pset, world = ctx.args
        scale = _scatter_scale(op, pre, post, pset, world)
        full = grouped_allgather_async([g.contiguous() for g in grads], None, pset, world=world).wait()
        return (None,) * 6 + tuple(f * scale for f in full)


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


def _no_adasum(op: Any) -> ReduceOp:
    return reject_adasum(to_reduce_op(op), "the differentiable collectives (a tensor that requires "
                         "grad); detach() it to combine it with Adasum")


def allreduce_with_grad(tensor: torch.Tensor, op: Any, pre: float, post: float, pset: Any,
                        world: Any) -> torch.Tensor:
    """Differentiable allreduce (no compression on this path)."""
    return _Allreduce.apply(tensor, _no_adasum(op), pre, post, pset, world)


def allgather_with_grad(tensor: torch.Tensor, pset: Any, world: Any) -> torch.Tensor:
    """Differentiable allgather."""
    return _Allgather.apply(tensor, pset, world)


def broadcast_with_grad(tensor: torch.Tensor, root_rank: int, pset: Any, world: Any) -> torch.Tensor:
    """Differentiable broadcast."""
    return _Broadcast.apply(tensor, root_rank, pset, world)


def grouped_allreduce_with_grad(tensors: list[torch.Tensor], op: Any, pre: float, post: float,
                                name: Any, pset: Any, world: Any) -> list[torch.Tensor]:
    """Differentiable grouped allreduce (no compression on this path)."""
    return list(_GroupedAllreduce.apply(_no_adasum(op), pre, post, name, pset, world, *tensors))


def grouped_allgather_with_grad(tensors: list[torch.Tensor], name: Any, pset: Any,
                                world: Any) -> list[torch.Tensor]:
    """Differentiable grouped allgather."""
    return list(_GroupedAllgather.apply(name, pset, world, *tensors))


def alltoall_with_grad(tensor: torch.Tensor, splits: Any, name: Any, pset: Any,
                       world: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable alltoall: ``(output, received_splits)``."""
    return _Alltoall.apply(tensor, splits, name, pset, world)


def reducescatter_with_grad(tensor: torch.Tensor, op: Any, pre: float, post: float, name: Any,
                            pset: Any, world: Any) -> torch.Tensor:
    """Differentiable reducescatter."""
    return _Reducescatter.apply(tensor, _no_adasum(op), pre, post, name, pset, world)


def grouped_reducescatter_with_grad(tensors: list[torch.Tensor], op: Any, pre: float, post: float,
                                    name: Any, pset: Any, world: Any) -> list[torch.Tensor]:
    """Differentiable grouped reducescatter."""
    return list(_GroupedReducescatter.apply(_no_adasum(op), pre, post, name, pset, world, *tensors))

"""Collectives over a :class:`~hvd_trainer.comm.world.World`: Horovod semantics on
``torch.distributed``.

Every function takes the world explicitly (``world=None`` means the one from
:func:`~hvd_trainer.comm.world.get_world`). CPU tensors travel over the world's gloo group even
when the main backend is NCCL. Results are new tensors unless the name ends in ``_``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hvd_trainer.comm.ops import ReduceOp, to_reduce_op
from hvd_trainer.comm.world import World, get_world

__all__ = [
    "allreduce",
    "allreduce_",
    "allgather",
    "broadcast",
    "broadcast_",
    "barrier",
    "broadcast_object",
    "allgather_object",
]


def _world(world: World | None) -> World:
    return get_world() if world is None else world


def _check_tensor(tensor: Any, fn: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn} expects a torch.Tensor, got {type(tensor).__name__}.")
    return tensor


def _average_inplace(tensor: torch.Tensor, size: int) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(size)
    elif tensor.dtype == torch.bool:
        raise TypeError("Average of a bool tensor is undefined; use Sum, Min or Max.")
    else:
        # Integer Average: the exact sum divided by the world size, rounded toward zero, in
        # the input dtype (Horovod divides integers the same way).
        tensor.copy_(torch.div(tensor, size, rounding_mode="trunc"))


def allreduce_(
    tensor: torch.Tensor,
    op: ReduceOp | str | None = None,
    name: str | None = None,
    *,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    world: World | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks, in place, and return it.

    Args:
        tensor: any shape and dtype, identical on every rank.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` (or a string /
            ``torch.distributed.ReduceOp``). Integer ``Average`` = sum // size (toward zero).
        name: label for error messages and the timeline.
        prescale_factor: multiply by this before reducing.
        postscale_factor: multiply by this after reducing.

    Raises:
        TypeError: not a tensor, or ``Average`` of a bool tensor.
    """
    _check_tensor(tensor, "allreduce")
    w = _world(world)
    rop = to_reduce_op(op)
    low_precision = tensor.dtype in (torch.float16, torch.bfloat16)
    if prescale_factor != 1.0:
        tensor.mul_(prescale_factor)
    if rop is ReduceOp.AVERAGE and low_precision:
        # Divide first so the fp16/bf16 sum cannot overflow to inf.
        tensor.div_(w.size)
    dist.all_reduce(tensor, op=rop.torch_op, group=w.group_for(tensor))
    if rop is ReduceOp.AVERAGE and not low_precision:
        _average_inplace(tensor, w.size)
    if postscale_factor != 1.0:
        tensor.mul_(postscale_factor)
    return tensor


def allreduce(
    tensor: torch.Tensor,
    op: ReduceOp | str | None = None,
    name: str | None = None,
    *,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    world: World | None = None,
) -> torch.Tensor:
    """Out-of-place :func:`allreduce_`: returns a new tensor, ``tensor`` is unchanged."""
    _check_tensor(tensor, "allreduce")
    return allreduce_(
        tensor.detach().clone(),
        op,
        name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        world=world,
    )


def allgather(tensor: torch.Tensor, name: str | None = None, *, world: World | None = None):
    """Concatenate every rank's ``tensor`` along dim 0, in rank order.

    Args:
        tensor: shape ``[n_r, *rest]``; ``n_r`` may differ per rank, ``rest`` and dtype must
            match. A 0-d tensor is treated as shape ``[1]``.

    Returns:
        Tensor of shape ``[sum_r n_r, *rest]``.
    """
    _check_tensor(tensor, "allgather")
    w = _world(world)
    t = tensor.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    t = t.contiguous()
    group = w.group_for(t)
    rows = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    all_rows = [torch.zeros_like(rows) for _ in range(w.size)]
    dist.all_gather(all_rows, rows, group=group)
    counts = [int(r.item()) for r in all_rows]
    max_rows = max(counts)
    padded = t
    if t.shape[0] < max_rows:
        pad = t.new_zeros((max_rows - t.shape[0], *t.shape[1:]))
        padded = torch.cat([t, pad], dim=0)
    out = [torch.empty_like(padded) for _ in range(w.size)]
    dist.all_gather(out, padded, group=group)
    return torch.cat([o[:c] for o, c in zip(out, counts, strict=True)], dim=0)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, *, world: World | None = None
) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with ``root_rank``'s values, in place, and return it.

    Raises:
        ValueError: ``root_rank`` outside ``[0, size)``.
    """
    _check_tensor(tensor, "broadcast")
    w = _world(world)
    if not 0 <= root_rank < w.size:
        raise ValueError(f"root_rank={root_rank} is not a rank of a world of size {w.size}.")
    dist.broadcast(tensor, src=root_rank, group=w.group_for(tensor))
    return tensor


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, *, world: World | None = None
) -> torch.Tensor:
    """Out-of-place :func:`broadcast_`."""
    _check_tensor(tensor, "broadcast")
    return broadcast_(tensor.detach().clone(), root_rank, name, world=world)


def barrier(*, world: World | None = None) -> None:
    """Block until every rank reaches this call."""
    w = _world(world)
    dist.barrier(group=w.cpu_group)


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, *, world: World | None = None
) -> Any:
    """Return ``root_rank``'s ``obj`` (pickled) on every rank."""
    w = _world(world)
    if not 0 <= root_rank < w.size:
        raise ValueError(f"root_rank={root_rank} is not a rank of a world of size {w.size}.")
    box = [obj if w.rank == root_rank else None]
    dist.broadcast_object_list(box, src=root_rank, group=w.cpu_group)
    return box[0]


def allgather_object(obj: Any, name: str | None = None, *, world: World | None = None) -> list:
    """Return the list of every rank's ``obj`` (pickled), in rank order."""
    w = _world(world)
    out: list[Any] = [None] * w.size
    dist.all_gather_object(out, obj, group=w.cpu_group)
    return out

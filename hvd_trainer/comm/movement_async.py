"""Asynchronous and grouped forms of the data-moving collectives (Horovod's ``*_async`` and
``grouped_*`` names): ``allgather_async``, ``broadcast_async(_)``, ``alltoall_async``,
``reducescatter_async``, ``grouped_allgather(_async)``, ``grouped_reducescatter(_async)``.

Each returns a :class:`~hvd_trainer.comm.collectives.Handle` for
:func:`~hvd_trainer.comm.collectives.poll` / :func:`~hvd_trainer.comm.collectives.synchronize`.
The payload transfer runs in the background; allgather and alltoall first exchange row counts,
which the call waits for (a few bytes). Each collective is checked across ranks with the same
signature as its blocking form, so one rank may use the async form while another blocks.
Not differentiable (use the blocking forms for autograd), as in Horovod. The blocking forms in
:mod:`hvd_trainer.comm.movement` are these plus ``wait()``, so both run the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hvd_trainer.comm.checks import Op
from hvd_trainer.comm.collectives import Handle, grouped_allreduce_async
from hvd_trainer.comm.errors import CommValueError
from hvd_trainer.comm.movement import _begin, _splits, _step, _tensor
from hvd_trainer.comm.ops import ReduceOp, to_reduce_op
from hvd_trainer.comm.process_set import ProcessSet, resolve_set
from hvd_trainer.comm.reduce import start_allreduce
from hvd_trainer.comm.world import World

__all__ = [
    "allgather_async", "broadcast_async", "broadcast_async_", "alltoall_async", "reducescatter_async",
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
    "grouped_reducescatter_async",
]


class _Launched:
    """A launched transport call of one checked collective (what a Handle waits on)."""

    __slots__ = ("pset", "op")

    def __init__(self, pset: ProcessSet, op: Op, work: Any) -> None:
        self.pset, self.op = pset, op
        pset.coordinator.launched(op, work)

    def poll(self) -> bool:
        return self.op.done or self.op.work is None or bool(self.op.work.is_completed())

    def finish(self) -> None:
        self.pset.coordinator.wait(self.op)


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet | None = None, *,
    world: World | None = None,
) -> Handle:
    """Start :func:`~hvd_trainer.comm.movement.allgather`; ``synchronize`` returns the tensor of
    shape ``[sum_r n_r, *rest]`` (every member's rows, in rank order).

    Raises:
        CollectiveMismatchError: trailing shape, ndim or dtype differ between ranks.
    """
    _tensor(tensor, "allgather")
    pset = resolve_set(process_set, world, "allgather")
    t = tensor.detach()
    t = (t.reshape(1) if t.dim() == 0 else t).contiguous()
    op = _begin(pset, "allgather", name, t, ndim=t.dim(), trailing_shape=list(t.shape[1:]))
    group = pset.group_for(t)
    rows = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    all_rows = [torch.zeros_like(rows) for _ in range(pset.size())]
    _step(pset, op, dist.all_gather(all_rows, rows, group=group, async_op=True))
    counts = [int(r.item()) for r in all_rows]
    max_rows = max(counts)
    padded = t
    if t.shape[0] < max_rows:
        padded = torch.cat([t, t.new_zeros((max_rows - t.shape[0], *t.shape[1:]))], dim=0)
    out = [torch.empty_like(padded) for _ in range(pset.size())]
    work = dist.all_gather(out, padded, group=group, async_op=True) if max_rows else None
    launched = _Launched(pset, op, work)

    def finish() -> torch.Tensor:
        if not max_rows:
            return t.new_empty((0, *t.shape[1:]))
        return torch.cat([o[:c] for o, c in zip(out, counts, strict=True)], dim=0)

    return Handle([launched], finish)


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None,
    process_set: ProcessSet | None = None, *, world: World | None = None,
) -> Handle:
    """Start overwriting ``tensor`` with ``root_rank``'s values, in place; ``synchronize``
    returns ``tensor``. Do not read or write ``tensor`` until then.

    Raises:
        CommValueError: ``root_rank`` (a global rank) is not a member of the set.
        CollectiveMismatchError: shape, dtype or root differ between ranks.
    """
    _tensor(tensor, "broadcast")
    pset = resolve_set(process_set, world, "broadcast")
    if root_rank not in pset.ranks:
        raise CommValueError(
            f"root_rank={root_rank} is not in process set {list(pset.ranks)}. "
            "HINT: root_rank is a global rank and must be a member of the set."
        )
    op = _begin(pset, "broadcast", name, tensor, shape=list(tensor.shape), root_rank=root_rank)
    buf = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
    work = dist.broadcast(buf, src=root_rank, group=pset.group_for(buf), async_op=True)

    @torch.no_grad()
    def finish() -> torch.Tensor:
        if buf.data_ptr() != tensor.data_ptr():
            tensor.copy_(buf)
        return tensor

    return Handle([_Launched(pset, op, work)], finish)


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None,
    process_set: ProcessSet | None = None, *, world: World | None = None,
) -> Handle:
    """Out-of-place :func:`broadcast_async_`: ``tensor`` is unchanged; ``synchronize`` returns
    a new tensor holding ``root_rank``'s values (same shape and dtype)."""
    _tensor(tensor, "broadcast")
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set, world=world)


def alltoall_async(
    tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None, name: str | None = None,
    process_set: ProcessSet | None = None, *, world: World | None = None,
) -> Handle:
    """Start :func:`~hvd_trainer.comm.movement.alltoall`. As in Horovod, ``synchronize`` returns
    ``(output, received_splits)`` whether or not ``splits`` was given: ``output`` holds the
    rows from member 0, then member 1, ...; ``received_splits`` is an int32 tensor of the row
    counts received from each member.

    Raises:
        CommValueError: a 0-d tensor, dim 0 not divisible by the set size (no splits), or bad
            splits. CollectiveMismatchError: trailing shape or dtype differ between ranks.
    """
    _tensor(tensor, "alltoall")
    pset = resolve_set(process_set, world, "alltoall")
    t = tensor.detach().contiguous()
    if t.dim() == 0:
        raise CommValueError("alltoall needs a tensor with at least one dimension, got a scalar.")
    send = _splits(t, splits, pset.size())
    op = _begin(pset, "alltoall", name, t, ndim=t.dim(), trailing_shape=list(t.shape[1:]),
                splits_given=splits is not None)
    group = pset.group_for(t)
    send_t = torch.tensor(send, dtype=torch.int64, device=t.device)
    recv_t = torch.empty_like(send_t)
    _step(pset, op, dist.all_to_all_single(recv_t, send_t, group=group, async_op=True))
    recv = [int(x) for x in recv_t.tolist()]
    out = t.new_empty((sum(recv), *t.shape[1:]))
    work = dist.all_to_all_single(out, t, output_split_sizes=recv, input_split_sizes=send,
                                  group=group, async_op=True)
    return Handle([_Launched(pset, op, work)], lambda: (out, recv_t.to(torch.int32)))


def _block(full: torch.Tensor, n: int, me: int) -> torch.Tensor:
    """Member ``me``'s block of dim 0 out of ``n`` (the first ``rows % n`` get one extra row)."""
    base, extra = divmod(full.shape[0], n)
    start = me * base + min(me, extra)
    return full[start : start + base + (1 if me < extra else 0)].clone()


def reducescatter_async(
    tensor: torch.Tensor, op: ReduceOp | str | None = None, name: str | None = None,
    process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, *, world: World | None = None,
) -> Handle:
    """Start :func:`~hvd_trainer.comm.movement.reducescatter`; ``synchronize`` returns this
    member's block of dim 0 of the reduced tensor (blocks as even as possible, the first
    ``rows % n`` members getting one extra row).

    Raises:
        CommValueError: a 0-d tensor. CommTypeError: bool Average/Product.
    """
    _tensor(tensor, "reducescatter")
    if tensor.dim() == 0:
        raise CommValueError("reducescatter needs a tensor with at least one dimension, got a scalar.")
    pset = resolve_set(process_set, world, "reducescatter")
    full = tensor.detach().clone(memory_format=torch.contiguous_format)
    red = start_allreduce(full, op=to_reduce_op(op), pset=pset, name=name, kind="reducescatter",
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    return Handle([red], lambda: _block(full, pset.size(), pset.rank()))


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet | None = None,
    *, world: World | None = None,
) -> Handle:
    """Allgather each tensor of the list (one collective each, launched back to back);
    ``synchronize`` returns the list of gathered tensors, in order.

    Raises:
        CommValueError: an empty list. Otherwise as :func:`allgather_async`, per tensor.
    """
    tensors = list(tensors)
    if not tensors:
        raise CommValueError("grouped_allgather got an empty list. HINT: pass at least one tensor.")
    handles = [allgather_async(t, f"{name}.{i}" if name else None, process_set, world=world)
               for i, t in enumerate(tensors)]
    return Handle(handles, lambda: [h.wait() for h in handles])


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet | None = None,
    *, world: World | None = None,
) -> list[torch.Tensor]:
    """Blocking :func:`grouped_allgather_async`: the list of gathered tensors."""
    return grouped_allgather_async(tensors, name, process_set, world=world).wait()


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor], op: ReduceOp | str | None = None, name: str | None = None,
    process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, *, world: World | None = None,
) -> Handle:
    """Reduce-scatter each tensor of the list, fused into one allreduce per dtype (as
    :func:`~hvd_trainer.comm.collectives.grouped_allreduce`); ``synchronize`` returns the list
    of this member's blocks, in order.

    Raises:
        CommValueError: an empty list or a 0-d tensor.
    """
    tensors = [_tensor(t, "grouped_reducescatter") for t in tensors]
    if not tensors:
        raise CommValueError("grouped_reducescatter got an empty list. HINT: pass at least one tensor.")
    if any(t.dim() == 0 for t in tensors):
        raise CommValueError("grouped_reducescatter needs tensors with at least one dimension, "
                             "got a scalar.")
    pset = resolve_set(process_set, world, "grouped_reducescatter")
    inner = grouped_allreduce_async(tensors, op, name, prescale_factor, postscale_factor,
                                    process_set=process_set, world=world)
    return Handle([inner], lambda: [_block(r, pset.size(), pset.rank()) for r in inner.wait()])


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor], op: ReduceOp | str | None = None, name: str | None = None,
    process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, *, world: World | None = None,
) -> list[torch.Tensor]:
    """Blocking :func:`grouped_reducescatter_async`: the list of this member's blocks."""
    return grouped_reducescatter_async(tensors, op, name, process_set, prescale_factor,
                                       postscale_factor, world=world).wait()

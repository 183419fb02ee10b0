"""Asynchronous forms of the data-moving collectives (Horovod's ``*_async`` names):
``allgather_async``, ``broadcast_async(_)``, ``alltoall_async``, ``grouped_allgather_async``,
and ``barrier_async``.

Each returns a :class:`~hvd_trainer.comm.ops.handle.Handle` for
:func:`~hvd_trainer.comm.ops.handle.poll` / :func:`~hvd_trainer.comm.ops.handle.synchronize`.
The payload transfer runs in the background; allgather and alltoall first exchange row counts,
which the call waits for (a few bytes). Each collective is checked across ranks with the same
signature as its blocking form, so one rank may use the async form while another blocks (these
functions match by call order; the public ``hvd_trainer.comm.*_async`` match a *named* call by
name, :mod:`hvd_trainer.comm.ops.by_name`, and pair only with the same named async call).
Not differentiable (use the blocking forms for autograd), as in Horovod. The blocking forms in
:mod:`hvd_trainer.comm.ops.collectives` are these plus ``wait()``, so both run the same code.

Every function takes ``process_set=`` (``None``: the whole job; this rank must be a member) and
``world=``; ``root_rank`` is always a global rank. Every dtype of
:data:`~hvd_trainer.comm.ops.flatten.SUPPORTED_DTYPES` travels, the ones the transports lack
(int16, unsigned 16/32/64-bit) widened for the wire and returned in their own dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hvd_trainer.comm.base.errors import CommValueError
from hvd_trainer.comm.ops.arguments import require_tensor
from hvd_trainer.comm.ops.checks import Op, Signature
from hvd_trainer.comm.ops.flatten import check_dtype, from_wire, to_wire
from hvd_trainer.comm.ops.handle import Handle, Launched
from hvd_trainer.comm.ops.process_set import ProcessSet, resolve_set
from hvd_trainer.comm.world.world import World

__all__ = [
    "allgather_async", "broadcast_async", "broadcast_async_", "alltoall_async",
    "grouped_allgather_async", "barrier_async",
]


def _begin(pset: ProcessSet, kind: str, name: str | None, t: torch.Tensor | None, **fields: Any) -> Op:
    base: dict[str, Any] = {}
    if t is not None:
        check_dtype(t.dtype, kind)
        base = {"dtype": str(t.dtype), "device": t.device.type}
    sig = Signature(kind, name, tuple({**fields, **base}.items()))
    nbytes = 0 if t is None else t.numel() * t.element_size()
    op = pset.coordinator.begin(sig, nbytes)
    op.extra["device"] = "cpu" if t is None else t.device.type
    return op


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet | None = None, *,
    world: World | None = None,
) -> Handle:
    """Start concatenating every member's ``tensor`` along dim 0, in rank order.

    Args:
        tensor: shape ``[n_r, *rest]``; ``n_r`` may differ per rank (0 allowed), ``rest`` and
            dtype must match. A 0-d tensor is treated as shape ``[1]``.

    Returns:
        A handle whose result is the tensor of shape ``[sum_r n_r, *rest]``.

    Raises:
        CollectiveMismatchError: trailing shape, ndim or dtype differ between ranks.
    """
    require_tensor(tensor, "allgather")
    pset = resolve_set(process_set, world, "allgather")
    t = tensor.detach()
    t = (t.reshape(1) if t.dim() == 0 else t).contiguous()
    op = _begin(pset, "allgather", name, t, ndim=t.dim(), trailing_shape=list(t.shape[1:]))
    dtype, t = t.dtype, to_wire(t)
    group = pset.group_for(t)
    rows = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    all_rows = [torch.zeros_like(rows) for _ in range(pset.size())]
    pset.coordinator.wait_work(op, dist.all_gather(all_rows, rows, group=group, async_op=True))
    counts = [int(r.item()) for r in all_rows]
    max_rows = max(counts)
    padded = t
    if t.shape[0] < max_rows:
        padded = torch.cat([t, t.new_zeros((max_rows - t.shape[0], *t.shape[1:]))], dim=0)
    out = [torch.empty_like(padded) for _ in range(pset.size())]
    work = dist.all_gather(out, padded, group=group, async_op=True) if max_rows else None
    launched = Launched(pset, op, work)

    def finish() -> torch.Tensor:
        if not max_rows:
            return t.new_empty((0, *t.shape[1:]), dtype=dtype)
        return from_wire(torch.cat([o[:c] for o, c in zip(out, counts, strict=True)], dim=0), dtype)

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
    require_tensor(tensor, "broadcast")
    pset = resolve_set(process_set, world, "broadcast")
    with pset.coordinator.local_checks("broadcast", name):  # a local error still consumes a seq
        if root_rank not in pset.ranks:
            raise CommValueError(
                f"root_rank={root_rank} is not in process set {list(pset.ranks)}. "
                "HINT: root_rank is a global rank and must be a member of the set."
            )
    op = _begin(pset, "broadcast", name, tensor, shape=list(tensor.shape), root_rank=root_rank)
    buf = to_wire(tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous())
    work = dist.broadcast(buf, src=root_rank, group=pset.group_for(buf), async_op=True)

    @torch.no_grad()
    def finish() -> torch.Tensor:
        if buf.data_ptr() != tensor.data_ptr():
            tensor.copy_(from_wire(buf, tensor.dtype))
        return tensor

    return Handle([Launched(pset, op, work)], finish)


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None,
    process_set: ProcessSet | None = None, *, world: World | None = None,
) -> Handle:
    """Out-of-place :func:`broadcast_async_`: ``tensor`` is unchanged; ``synchronize`` returns
    a new tensor holding ``root_rank``'s values (same shape and dtype)."""
    require_tensor(tensor, "broadcast")
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set, world=world)


def _splits(tensor: torch.Tensor, splits: Any, n: int) -> list[int]:
    rows = tensor.shape[0]
    if splits is None:
        if rows % n:
            raise CommValueError(
                f"alltoall without splits needs dim 0 ({rows}) divisible by the set size {n}. "
                "HINT: pass splits=[rows for rank 0, rows for rank 1, ...]."
            )
        return [rows // n] * n
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype == torch.bool:
            raise CommValueError(f"alltoall splits must be integers, got dtype {splits.dtype}.")
        splits = splits.tolist()
    values = [int(s) for s in splits]
    if len(values) != n or any(s < 0 for s in values) or sum(values) != rows:
        raise CommValueError(
            f"alltoall splits={values} must be {n} non-negative counts summing to dim 0 ({rows})."
        )
    return values


def alltoall_async(
    tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None, name: str | None = None,
    process_set: ProcessSet | None = None, *, world: World | None = None,
) -> Handle:
    """Start sending ``splits[i]`` rows of ``tensor`` (in order) to the i-th member and receiving
    theirs. As in Horovod, ``synchronize`` returns ``(output, received_splits)`` whether or not
    ``splits`` was given: ``output`` holds the rows from member 0, then member 1, ...;
    ``received_splits`` is an int32 tensor of the row counts received from each member.

    Raises:
        CommValueError: a 0-d tensor, dim 0 not divisible by the set size (no splits), or bad
            splits. CollectiveMismatchError: trailing shape or dtype differ between ranks.
    """
    require_tensor(tensor, "alltoall")
    pset = resolve_set(process_set, world, "alltoall")
    t = tensor.detach().contiguous()
    with pset.coordinator.local_checks("alltoall", name):  # a local error still consumes a seq
        if t.dim() == 0:
            raise CommValueError("alltoall needs a tensor with at least one dimension, got a scalar.")
        send = _splits(t, splits, pset.size())
    op = _begin(pset, "alltoall", name, t, ndim=t.dim(), trailing_shape=list(t.shape[1:]),
                splits_given=splits is not None)
    dtype, t = t.dtype, to_wire(t)
    group = pset.group_for(t)
    send_t = torch.tensor(send, dtype=torch.int64, device=t.device)
    recv_t = torch.empty_like(send_t)
    pset.coordinator.wait_work(op, dist.all_to_all_single(recv_t, send_t, group=group, async_op=True))
    recv = [int(x) for x in recv_t.tolist()]
    out = t.new_empty((sum(recv), *t.shape[1:]))
    work = dist.all_to_all_single(out, t, output_split_sizes=recv, input_split_sizes=send,
                                  group=group, async_op=True)
    return Handle([Launched(pset, op, work)], lambda: (from_wire(out, dtype), recv_t.to(torch.int32)))


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


def barrier_async(process_set: ProcessSet | None = None, *, world: World | None = None) -> Handle:
    """Start a barrier; ``synchronize`` returns ``None`` once every member has reached it."""
    pset = resolve_set(process_set, world, "barrier")
    op = _begin(pset, "barrier", None, None)
    return Handle([Launched(pset, op, dist.barrier(group=pset.cpu_group, async_op=True))], lambda: None)

"""Collectives that move data (allgather, broadcast, alltoall, reducescatter), objects, barrier
and join, with Horovod semantics on ``torch.distributed``.

Every function takes ``process_set=`` (``None``: the whole job; this rank must be a member) and
``world=``; ``root_rank`` is always a global rank. Each one is checked across ranks first
(:mod:`hvd_trainer.comm.checks`) and waits with stall inspection.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hvd_trainer.comm.autograd import allgather_with_grad, broadcast_with_grad, needs_autograd
from hvd_trainer.comm.checks import Op, Signature
from hvd_trainer.comm.errors import CommTypeError, CommValueError, StallError
from hvd_trainer.comm.fatal import exit_hard_at_exit
from hvd_trainer.comm.ops import ReduceOp, to_reduce_op  # noqa: F401 (annotations)
from hvd_trainer.comm.process_set import ProcessSet, resolve_set
from hvd_trainer.comm.reduce import run_identity_allreduce
from hvd_trainer.comm.world import World

__all__ = [
    "allgather",
    "broadcast",
    "broadcast_",
    "alltoall",
    "reducescatter",
    "barrier",
    "broadcast_object",
    "allgather_object",
    "join",
]


def _tensor(tensor: Any, fn: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise CommTypeError(f"{fn} expects a torch.Tensor, got {type(tensor).__name__}.")
    return tensor


def _begin(pset: ProcessSet, kind: str, name: str | None, t: torch.Tensor | None, **fields: Any) -> Op:
    base: dict[str, Any] = {}
    if t is not None:
        base = {"dtype": str(t.dtype), "device": t.device.type}
    sig = Signature(kind, name, tuple({**fields, **base}.items()))
    nbytes = 0 if t is None else t.numel() * t.element_size()
    op = pset.coordinator.begin(sig, nbytes)
    op.extra["device"] = "cpu" if t is None else t.device.type
    return op


def _step(pset: ProcessSet, op: Op, work: Any, last: bool = False) -> None:
    if last:
        pset.coordinator.launched(op, work)
        pset.coordinator.wait(op)
    else:
        pset.coordinator.wait_work(op, work)


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet | None = None, *,
    world: World | None = None,
) -> torch.Tensor:
    """Concatenate every member's ``tensor`` along dim 0, in rank order.

    Args:
        tensor: shape ``[n_r, *rest]``; ``n_r`` may differ per rank (0 allowed), ``rest`` and
            dtype must match. A 0-d tensor is treated as shape ``[1]``.

    Returns:
        Tensor of shape ``[sum_r n_r, *rest]``.

    Raises:
        CollectiveMismatchError: ``rest``, ndim or dtype differ between ranks.
    """
    _tensor(tensor, "allgather")
    if needs_autograd(tensor):  # backward: average the gradient, keep this rank's rows
        return allgather_with_grad(tensor, process_set, world)
    from hvd_trainer.comm.movement_async import allgather_async

    return allgather_async(tensor, name, process_set, world=world).wait()


@torch.no_grad()  # writes into parameters in place (broadcast_parameters)
def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None,
    process_set: ProcessSet | None = None, *, world: World | None = None,
) -> torch.Tensor:
    """Overwrite ``tensor`` on every member with ``root_rank``'s values, in place; return it.

    Raises:
        CommValueError: ``root_rank`` is not a member of the set.
        CollectiveMismatchError: shape, dtype or root differ between ranks.
    """
    from hvd_trainer.comm.movement_async import broadcast_async_

    return broadcast_async_(tensor, root_rank, name, process_set, world=world).wait()


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None,
    process_set: ProcessSet | None = None, *, world: World | None = None,
) -> torch.Tensor:
    """Out-of-place :func:`broadcast_`: returns ``root_rank``'s tensor; ``tensor`` unchanged.

    Differentiable when ``tensor`` requires grad: the gradient is averaged over the set and
    kept on the root (zeros elsewhere), as in Horovod.
    """
    _tensor(tensor, "broadcast")
    if needs_autograd(tensor):
        return broadcast_with_grad(tensor, root_rank, process_set, world)
    return broadcast_(tensor.detach().clone(), root_rank, name, process_set, world=world)


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


def alltoall(
    tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None, name: str | None = None,
    process_set: ProcessSet | None = None, *, world: World | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[i]`` rows of ``tensor`` (in order) to the i-th member; receive theirs.

    Returns:
        ``output`` (rows from member 0, then member 1, ...) or, when ``splits`` is given,
        ``(output, received_splits)`` with ``received_splits`` an int32 tensor.

    Raises:
        CommValueError: dim 0 not divisible by the set size (no splits), or bad splits.
        CollectiveMismatchError: trailing shape or dtype differ between ranks.
    """
    from hvd_trainer.comm.movement_async import alltoall_async

    out, received_splits = alltoall_async(tensor, splits, name, process_set, world=world).wait()
    return out if splits is None else (out, received_splits)


def reducescatter(
    tensor: torch.Tensor, op: ReduceOp | str | None = None, name: str | None = None,
    process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, *, world: World | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over the set, then give member ``i`` its block of dim 0.

    Blocks are as even as possible, the first ``rows % n`` members getting one extra row
    (Horovod's split). Implemented as an allreduce then a slice (correct on every backend; it
    moves ``n/2`` times the bytes of a native reduce-scatter).

    Raises:
        CommValueError: a 0-d tensor. JoinedRankError: a rank has joined.
    """
    from hvd_trainer.comm.movement_async import reducescatter_async

    return reducescatter_async(tensor, op, name, process_set, prescale_factor, postscale_factor,
                               world=world).wait()


def barrier(process_set: ProcessSet | None = None, *, world: World | None = None) -> None:
    """Block until every member reaches this call."""
    pset = resolve_set(process_set, world, "barrier")
    op = _begin(pset, "barrier", None, None)
    _step(pset, op, dist.barrier(group=pset.cpu_group, async_op=True), last=True)


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet | None = None,
    *, world: World | None = None,
) -> Any:
    """Return ``root_rank``'s ``obj`` (pickled) on every member."""
    pset = resolve_set(process_set, world, "broadcast_object")
    me = pset.world.rank
    payload = pickle.dumps(obj) if me == root_rank else b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    broadcast_(length, root_rank, f"{name or 'object'}.length", pset)
    data = torch.zeros(int(length.item()), dtype=torch.uint8)
    if me == root_rank:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    broadcast_(data, root_rank, f"{name or 'object'}.bytes", pset)
    return obj if me == root_rank else pickle.loads(data.numpy().tobytes())


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet | None = None, *,
    world: World | None = None,
) -> list[Any]:
    """Return the list of every member's ``obj`` (pickled), in rank order."""
    pset = resolve_set(process_set, world, "allgather_object")
    payload = pickle.dumps(obj)
    lengths = allgather(torch.tensor([len(payload)], dtype=torch.int64), f"{name or 'object'}.length", pset)
    data = allgather(torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else
                     torch.zeros(0, dtype=torch.uint8), f"{name or 'object'}.bytes", pset)
    out, start = [], 0
    for n in lengths.tolist():
        out.append(pickle.loads(data[start : start + n].numpy().tobytes()))
        start += n
    return out


def join(process_set: ProcessSet | None = None, *, world: World | None = None) -> int:
    """Declare that this rank has no more data; return the rank that joined last.

    Until every member has joined, this rank takes part in the others' allreduces with zeros
    (identity elements for Min/Max/Product); ``Average`` still divides by the full set size.
    Other collectives by the active ranks raise :class:`JoinedRankError` on them and here.
    See :mod:`hvd_trainer.comm.join` for the protocol.

    Raises:
        JoinedRankError: an active rank ran a non-allreduce collective.
        StallError: ``stall_shutdown_seconds`` passed with ranks neither active nor joined.
    """
    pset = resolve_set(process_set, world, "join")
    coord = pset.coordinator
    for pending in sorted(coord.outstanding.values(), key=lambda o: o.seq):
        coord.wait(pending)
    if pset.size() == 1:
        return pset.world.rank
    cfg = coord.config
    warned = [False]

    def on_idle(seconds: float) -> None:
        text = f"rank {pset.world.rank} joined and has waited {seconds:.1f}s for the others to join."
        if cfg.stall_shutdown_seconds and seconds >= cfg.stall_shutdown_seconds:
            exit_hard_at_exit()  # the transport is wedged: never hang at exit
            raise StallError(text + " HINT: every rank must call join() when it runs out of data.")
        if cfg.stall_warning_seconds and seconds >= cfg.stall_warning_seconds and not warned[0]:
            warned[0] = True
            warnings.warn(text, RuntimeWarning, stacklevel=3)

    last, seq = coord.board.serve(coord.seq, lambda tr: run_identity_allreduce(tr, pset), on_idle)
    coord.seq = seq
    coord.forget_history()
    return last


"""The blocking collectives, with Horovod semantics on ``torch.distributed``: ``allreduce(_)``,
``grouped_allreduce(_)``, ``allgather``, ``grouped_allgather``, ``broadcast(_)``, ``alltoall``,
``reducescatter``, ``grouped_reducescatter``, ``barrier`` and ``join``.

Each one is its asynchronous form (:mod:`~hvd_trainer.comm.ops.reductions_async`,
:mod:`~hvd_trainer.comm.ops.movement_async`) followed by ``wait()``, so both run the same code and
the same cross-rank checks; ``allreduce``, ``allgather`` and ``broadcast`` of a tensor that
requires grad go through :mod:`~hvd_trainer.comm.ops.autograd` instead. ``join`` has no async form:
it serves the other ranks' allreduces until every rank has joined.

Every function takes ``process_set=`` (``None``: the whole job; this rank must be a member) and
``world=`` (``None``: the world from :func:`~hvd_trainer.comm.world.world.get_world`); ``root_rank``
is always a global rank. CPU tensors travel over gloo even when the main backend is NCCL.
Results are new tensors unless the name ends in ``_``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence

import torch

from hvd_trainer.comm.base.errors import CommTypeError, StallError
from hvd_trainer.comm.base.fatal import exit_hard_at_exit
from hvd_trainer.comm.ops import by_name
from hvd_trainer.comm.ops.arguments import require_tensor
from hvd_trainer.comm.ops.autograd import (
    allgather_with_grad,
    allreduce_with_grad,
    alltoall_with_grad,
    any_needs_autograd,
    broadcast_with_grad,
    grouped_allgather_with_grad,
    grouped_allreduce_with_grad,
    grouped_reducescatter_with_grad,
    needs_autograd,
    reducescatter_with_grad,
)
from hvd_trainer.comm.ops.compression import Compression, Compressor
from hvd_trainer.comm.ops.movement_async import (
    allgather_async,
    alltoall_async,
    barrier_async,
    broadcast_async_,
    grouped_allgather_async,
)
from hvd_trainer.comm.ops.ops import Average, ReduceOp, op_or_average
from hvd_trainer.comm.ops.process_set import ProcessSet, resolve_set
from hvd_trainer.comm.ops.reduce import run_identity_allreduce
from hvd_trainer.comm.ops.reductions_async import (
    allreduce_async,
    allreduce_async_,
    grouped_allreduce_async,
    grouped_reducescatter_async,
    reducescatter_async,
)
from hvd_trainer.comm.world.world import World

__all__ = [
    "allreduce",
    "allreduce_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "broadcast_",
    "alltoall",
    "reducescatter",
    "grouped_reducescatter",
    "barrier",
    "join",
]


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
    *,
    compression: Compressor = Compression.none,
    world: World | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over the set, in place, and return it. Horovod's positional order;
    see :func:`~hvd_trainer.comm.ops.reductions_async.allreduce_async_`."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                            process_set, compression=compression, world=world).wait()


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Compressor = Compression.none,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
    *,
    world: World | None = None,
) -> torch.Tensor:
    """Return the reduction of ``tensor`` over the set; ``tensor`` is unchanged.

    Horovod's positional order: ``(tensor, average, name, compression, op, prescale_factor,
    postscale_factor, process_set)``; arguments as
    :func:`~hvd_trainer.comm.ops.reductions_async.allreduce_async_`.

    Example:
        >>> hvd.allreduce(torch.tensor([float(hvd.rank())]))   # mean of the ranks

    Differentiable when ``tensor`` requires grad (backward: the same allreduce of the gradient,
    see :mod:`hvd_trainer.comm.ops.autograd`); compression is not applied on that path.
    """
    op = op_or_average(op, average)
    if isinstance(tensor, torch.Tensor) and needs_autograd(tensor):
        return allreduce_with_grad(tensor, op, prescale_factor, postscale_factor, process_set, world)
    return allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor, process_set,
                           compression=compression, world=world).wait()


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Compressor = Compression.none,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
    *,
    world: World | None = None,
) -> list[torch.Tensor]:
    """Out-of-place grouped allreduce (one fused collective per dtype); Horovod's positional
    order, as :func:`allreduce`. Differentiable when a tensor requires grad (each gradient is
    allreduced the same way; no compression on that path).

    Raises:
        CommValueError: an empty list or tensors on different devices.
    """
    op = op_or_average(op, average)
    tensors = list(tensors)
    if any_needs_autograd(tensors):
        return grouped_allreduce_with_grad(tensors, op, prescale_factor, postscale_factor, name,
                                           process_set, world)
    return grouped_allreduce_async(tensors, None, name, op, prescale_factor, postscale_factor,
                                   process_set, compression=compression, world=world).wait()


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
    *,
    compression: Compressor = Compression.none,
    world: World | None = None,
) -> list[torch.Tensor]:
    """In-place grouped allreduce; returns ``tensors``. Horovod's positional order, as
    :func:`allreduce_`."""
    return grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                   process_set, compression=compression, inplace=True,
                                   world=world).wait()


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
    require_tensor(tensor, "allgather")
    if needs_autograd(tensor):  # backward: average the gradient, keep this rank's rows
        return allgather_with_grad(tensor, process_set, world)
    return allgather_async(tensor, name, process_set, world=world).wait()


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet | None = None,
    *, world: World | None = None,
) -> list[torch.Tensor]:
    """Blocking :func:`~hvd_trainer.comm.ops.movement_async.grouped_allgather_async`: the list of
    gathered tensors. Differentiable when a tensor requires grad (as :func:`allgather`)."""
    tensors = list(tensors)
    if any_needs_autograd(tensors):
        return grouped_allgather_with_grad(tensors, name, process_set, world)
    return grouped_allgather_async(tensors, name, process_set, world=world).wait()


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
    return broadcast_async_(tensor, root_rank, name, process_set, world=world).wait()


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None,
    process_set: ProcessSet | None = None, *, world: World | None = None,
) -> torch.Tensor:
    """Out-of-place :func:`broadcast_`: returns ``root_rank``'s tensor; ``tensor`` unchanged.

    Differentiable when ``tensor`` requires grad: the gradient is averaged over the set and
    kept on the root (zeros elsewhere), as in Horovod.
    """
    require_tensor(tensor, "broadcast")
    if needs_autograd(tensor):
        return broadcast_with_grad(tensor, root_rank, process_set, world)
    return broadcast_(tensor.detach().clone(), root_rank, name, process_set, world=world)


def alltoall(
    tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None, name: str | None = None,
    process_set: ProcessSet | None = None, *, world: World | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[i]`` rows of ``tensor`` (in order) to the i-th member; receive theirs.

    Returns:
        ``output`` (rows from member 0, then member 1, ...) or, when ``splits`` is given,
        ``(output, received_splits)`` with ``received_splits`` an int32 tensor.
        Differentiable when ``tensor`` requires grad: the gradient of ``output`` travels back
        with the received splits, so each rank gets the gradient of the rows it sent.

    Raises:
        CommValueError: dim 0 not divisible by the set size (no splits), or bad splits.
        CollectiveMismatchError: trailing shape or dtype differ between ranks.
    """
    require_tensor(tensor, "alltoall")
    if needs_autograd(tensor):
        out, received_splits = alltoall_with_grad(tensor, splits, name, process_set, world)
    else:
        out, received_splits = alltoall_async(tensor, splits, name, process_set, world=world).wait()
    return out if splits is None else (out, received_splits)


def reducescatter(
    tensor: torch.Tensor, name: str | None = None, compression: Compressor = Compression.none,
    op: ReduceOp | str | None = Average, process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0, *, world: World | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over the set, then give member ``i`` its block of dim 0.

    Horovod's positional order: ``(tensor, name, compression, op, process_set,
    prescale_factor, postscale_factor)``. Blocks are as even as possible, the first
    ``rows % n`` members getting one extra row (Horovod's split). Implemented as an allreduce
    then a slice (correct on every backend; it moves ``n/2`` times the bytes of a native
    reduce-scatter). Differentiable when ``tensor`` requires grad (backward: the allgather of
    the blocks' gradients, see :mod:`hvd_trainer.comm.ops.autograd`).

    Raises:
        CommValueError: a 0-d tensor. JoinedRankError: a rank has joined.

    ``compression`` casts floating tensors for the wire as in :func:`allreduce` (not on the
    differentiable path).
    """
    if isinstance(tensor, torch.Tensor) and needs_autograd(tensor):
        return reducescatter_with_grad(tensor, op, prescale_factor, postscale_factor, name,
                                       process_set, world)
    return reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor,
                               compression=compression, world=world).wait()


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor], name: str | None = None,
    compression: Compressor = Compression.none, op: ReduceOp | str | None = Average,
    process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, *, world: World | None = None,
) -> list[torch.Tensor]:
    """Blocking :func:`~hvd_trainer.comm.ops.reductions_async.grouped_reducescatter_async`: the
    list of this member's blocks. Horovod's positional order, as :func:`reducescatter`;
    differentiable the same way."""
    tensors = list(tensors)
    if any_needs_autograd(tensors):
        return grouped_reducescatter_with_grad(tensors, op, prescale_factor, postscale_factor, name,
                                               process_set, world)
    return grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                       postscale_factor, compression=compression, world=world).wait()


def barrier(process_set: ProcessSet | None = None, *, world: World | None = None) -> None:
    """Block until every member reaches this call."""
    barrier_async(process_set, world=world).wait()


def join(device: int | str | torch.device = -1, *, process_set: ProcessSet | None = None,
         world: World | None = None) -> int:
    """Declare that this rank has no more data; return the rank that joined last.

    ``device`` is Horovod's: the GPU its zero tensors would live on (``-1``: the current
    device). It is accepted and checked for type only; here each stand-in allreduce uses the
    device the active ranks announced (CPU tensors over gloo, CUDA ones on this rank's GPU).

    Named ``*_async`` collectives this rank started run to completion first (their results stay
    with their handles). Until every member has joined, this rank takes part in the others'
    allreduces, named async ones included, with zeros
    (identity elements for Min/Max/Product); ``Average`` still divides by the full set size.
    Other collectives by the active ranks raise :class:`JoinedRankError` on the ranks that call
    them (as in Horovod); the joined rank skips them and keeps waiting.
    See :mod:`hvd_trainer.comm.world.join_board` for the protocol.

    Raises:
        JoinedRankError: never here since a joined rank skips the active ranks' other collectives;
            the active caller gets it.
        StallError: ``stall_shutdown_seconds`` passed with ranks neither active nor joined.
    """
    if isinstance(device, bool) or not isinstance(device, int | str | torch.device):
        raise CommTypeError(
            f"join(device={device!r}): device must be a GPU index, a device string or a "
            "torch.device. HINT: join() or join(hvd.local_rank()); a process set goes as process_set=."
        )
    pset = resolve_set(process_set, world, "join")
    coord = pset.coordinator
    for pending in sorted(coord.outstanding.values(), key=lambda o: o.seq):
        coord.wait(pending)
    if pset.size() == 1:
        return pset.global_rank
    cfg = coord.config
    warned = [False]

    def on_idle(seconds: float) -> None:
        text = f"rank {pset.global_rank} joined and has waited {seconds:.1f}s for the others to join."
        if cfg.stall_shutdown_seconds and seconds >= cfg.stall_shutdown_seconds:
            exit_hard_at_exit()  # the transport is wedged: never hang at exit
            raise StallError(text + " HINT: every rank must call join() when it runs out of data.")
        if cfg.stall_warning_seconds and seconds >= cfg.stall_warning_seconds and not warned[0]:
            warned[0] = True
            warnings.warn(text, RuntimeWarning, stacklevel=3)

    matcher = by_name.matcher_for(pset)
    with matcher.joined() if matcher is not None else contextlib.nullcontext():
        last, seq = coord.board.serve(coord.seq, lambda tr: run_identity_allreduce(tr, pset), on_idle)
    coord.seq = seq
    coord.forget_history()
    return last

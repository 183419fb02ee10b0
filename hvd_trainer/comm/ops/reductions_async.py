"""Asynchronous reductions (Horovod's ``*_async`` names): ``allreduce_async(_)``,
``grouped_allreduce_async``, ``reducescatter_async`` and ``grouped_reducescatter_async``.

Each returns a :class:`~hvd_trainer.comm.ops.handle.Handle` for
:func:`~hvd_trainer.comm.ops.handle.poll` / :func:`~hvd_trainer.comm.ops.handle.synchronize`; the
blocking forms in :mod:`hvd_trainer.comm.ops.collectives` are these plus ``wait()``. Every function
takes ``process_set=`` (``None``: the whole job) and ``world=`` (``None``: the world from
:func:`~hvd_trainer.comm.world.world.get_world`). CPU tensors travel over gloo even when the main
backend is NCCL. Numerics (Average, integers, scale factors, compression) are described in
:mod:`hvd_trainer.comm.ops.reduce`. Not differentiable, as in Horovod.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hvd_trainer.comm.base.errors import CommTypeError, CommValueError
from hvd_trainer.comm.ops.adasum import AdasumReduction, start_adasum
from hvd_trainer.comm.ops.arguments import require_tensor
from hvd_trainer.comm.ops.compression import Compression, Compressor
from hvd_trainer.comm.ops.flatten import flatten
from hvd_trainer.comm.ops.handle import Handle
from hvd_trainer.comm.ops.ops import Average, ReduceOp, op_or_average, reject_adasum, to_reduce_op
from hvd_trainer.comm.ops.process_set import ProcessSet, resolve_set
from hvd_trainer.comm.ops.reduce import Reduction, signature, start_allreduce
from hvd_trainer.comm.world.world import World

__all__ = [
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "reducescatter_async",
    "grouped_reducescatter_async",
]


def allreduce_async_(
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
) -> Handle:
    """Start reducing ``tensor`` in place; :func:`synchronize` returns ``tensor``.

    Args:
        tensor: any shape and dtype, identical on every rank of the set.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` (or a string /
            ``torch.distributed.ReduceOp``). Integer ``Average`` is the exact integer sum
            divided by the set size, rounded toward zero, in the input dtype
            (``[1, 2] -> 1``, ``[-1, -2] -> -1``).
        average: Horovod's older flag (True: Average, False: Sum); not together with ``op``.
        name: label for error messages and the timeline.
        prescale_factor: multiply by this before the sum. postscale_factor: after it.
        process_set: the ranks to reduce over (this rank must be a member).
        compression: ``Compression.none`` / ``fp16`` / ``bf16`` (floating tensors only;
            keyword-only: Horovod's in-place and async forms have no ``compression``).

    The positional order is Horovod's: ``(tensor, average, name, op, prescale_factor,
    postscale_factor, process_set)``.

    Raises:
        CommTypeError: not a tensor; bool Average/Product. CommValueError: not a member.
        ValueError: both ``op`` and ``average``.
    """
    require_tensor(tensor, "allreduce")
    # argument errors (e.g. Adasum) before any process group is needed
    rop = to_reduce_op(op_or_average(op, average))
    pset = resolve_set(process_set, world, "allreduce")
    target = tensor if tensor.is_contiguous() else tensor.contiguous()
    if rop is ReduceOp.ADASUM:
        sig = signature("allreduce", name, target, rop, prescale_factor, postscale_factor,
                        Compression.resolve(compression, error=CommTypeError))
        red: Reduction | AdasumReduction = start_adasum(
            target, pset=pset, sig=sig, name=name, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, compression=compression,
        )
    else:
        red = start_allreduce(
            target, op=rop, pset=pset, name=name, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, compression=compression,
        )

    @torch.no_grad()
    def finish() -> torch.Tensor:
        if target is not tensor:
            tensor.copy_(target)
        return tensor

    return Handle([red], finish)


def allreduce_async(
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
) -> Handle:
    """Out-of-place :func:`allreduce_async_`: ``tensor`` is unchanged; the result is new."""
    require_tensor(tensor, "allreduce")
    op = op_or_average(op, average)
    return allreduce_async_(
        tensor.detach().clone(memory_format=torch.contiguous_format), None, name, op,
        prescale_factor, postscale_factor, process_set, compression=compression, world=world,
    )


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
    *,
    compression: Compressor = Compression.none,
    inplace: bool = False,
    world: World | None = None,
) -> Handle:
    """Reduce a list of tensors as one fused operation per dtype (one collective each).

    The tensors are packed into one flat buffer per dtype (in list order,
    :mod:`hvd_trainer.comm.ops.flatten`), reduced, and unpacked. :func:`synchronize` returns the
    list of results (the inputs when ``inplace``). Arguments and their positional order as
    :func:`allreduce_async_`.

    Raises:
        CommValueError: an empty list or tensors on different devices.
        CommTypeError: a dtype that cannot travel (see ``flatten.SUPPORTED_DTYPES``).
    """
    tensors = [require_tensor(t, "grouped_allreduce") for t in tensors]
    if not tensors:
        raise CommValueError("grouped_allreduce got an empty list. HINT: pass at least one tensor.")
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:
        raise CommValueError(f"grouped_allreduce needs one device, got tensors on {devices}.")
    pset = resolve_set(process_set, world, "grouped_allreduce")
    with pset.coordinator.local_checks("grouped_allreduce", name):  # a local error still consumes a seq
        rop = to_reduce_op(op_or_average(op, average))
        compression = Compression.resolve(compression, error=CommTypeError)
        groups = flatten(tensors, what="grouped_allreduce")
    reductions: list[Reduction | AdasumReduction] = []
    for group in groups:
        flat = group.flat
        label = f"{name}.{str(flat.dtype).replace('torch.', '')}" if name else None
        shapes = ("shapes", [list(s) for s in group.shapes])
        sig = signature("grouped_allreduce", label, flat, rop, prescale_factor, postscale_factor,
                        compression, (shapes,))
        if rop is ReduceOp.ADASUM:  # one Adasum per buffer, each tensor with its own coefficients
            reductions.append(start_adasum(
                flat, pset=pset, sig=sig, name=label, segments=_segments(group.shapes),
                prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                compression=compression, kind="grouped_allreduce",
            ))
            continue
        reductions.append(start_allreduce(
            flat, op=rop, pset=pset, name=label, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, compression=compression, kind="grouped_allreduce",
            sig=sig,
        ))

    @torch.no_grad()
    def finish() -> list[torch.Tensor]:
        out: list[torch.Tensor] = list(tensors)
        for group in groups:
            for i, view in zip(group.indices, group.views(), strict=True):
                if inplace:
                    tensors[i].copy_(view)
                else:
                    out[i] = view
        return out

    return Handle(reductions, finish)


def _segments(shapes: Sequence[torch.Size]) -> list[tuple[int, int]]:
    """``(offset, numel)`` of each tensor in a flat buffer of these shapes, in order."""
    out, offset = [], 0
    for shape in shapes:
        out.append((offset, shape.numel()))
        offset += shape.numel()
    return out


def grouped_allreduce_async_(
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
) -> Handle:
    """In-place :func:`grouped_allreduce_async`: ``synchronize`` returns ``tensors``, reduced."""
    return grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                   process_set, compression=compression, inplace=True, world=world)


def _block(full: torch.Tensor, n: int, me: int) -> torch.Tensor:
    """Member ``me``'s block of dim 0 out of ``n`` (the first ``rows % n`` get one extra row)."""
    base, extra = divmod(full.shape[0], n)
    start = me * base + min(me, extra)
    return full[start : start + base + (1 if me < extra else 0)].clone()


def reducescatter_async(
    tensor: torch.Tensor, name: str | None = None, op: ReduceOp | str | None = Average,
    process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, *, compression: Compressor = Compression.none,
    world: World | None = None,
) -> Handle:
    """Start :func:`~hvd_trainer.comm.ops.collectives.reducescatter`; ``synchronize`` returns this
    member's block of dim 0 of the reduced tensor (blocks as even as possible, the first
    ``rows % n`` members getting one extra row).

    Implemented as an allreduce then a slice (correct on every backend; it moves ``n/2`` times
    the bytes of a native reduce-scatter).

    Raises:
        CommValueError: a 0-d tensor. CommTypeError: bool Average/Product.
    """
    require_tensor(tensor, "reducescatter")
    if tensor.dim() == 0:
        raise CommValueError("reducescatter needs a tensor with at least one dimension, got a scalar.")
    rop = reject_adasum(to_reduce_op(op), "reducescatter")
    pset = resolve_set(process_set, world, "reducescatter")
    full = tensor.detach().clone(memory_format=torch.contiguous_format)
    red = start_allreduce(full, op=rop, pset=pset, name=name, kind="reducescatter",
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                          compression=compression)
    return Handle([red], lambda: _block(full, pset.size(), pset.rank()))


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, op: ReduceOp | str | None = Average,
    process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, *, compression: Compressor = Compression.none,
    world: World | None = None,
) -> Handle:
    """Reduce-scatter each tensor of the list, fused into one allreduce per dtype (as
    :func:`grouped_allreduce_async`); ``synchronize`` returns the list of this member's
    blocks, in order.

    Raises:
        CommValueError: an empty list or a 0-d tensor.
    """
    tensors = [require_tensor(t, "grouped_reducescatter") for t in tensors]
    if not tensors:
        raise CommValueError("grouped_reducescatter got an empty list. HINT: pass at least one tensor.")
    if any(t.dim() == 0 for t in tensors):
        raise CommValueError("grouped_reducescatter needs tensors with at least one dimension, "
                             "got a scalar.")
    reject_adasum(to_reduce_op(op), "grouped_reducescatter")
    pset = resolve_set(process_set, world, "grouped_reducescatter")
    inner = grouped_allreduce_async(tensors, None, name, op, prescale_factor, postscale_factor,
                                    process_set, compression=compression, world=world)
    return Handle([inner], lambda: [_block(r, pset.size(), pset.rank()) for r in inner.wait()])

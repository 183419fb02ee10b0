"""Reductions with Horovod semantics: ``allreduce`` (+ in-place and async forms),
``grouped_allreduce``, and the async handles ``poll`` / ``synchronize``.

Every function takes ``process_set=`` (``None``: the whole job) and ``world=`` (``None``: the
world from :func:`~hvd_trainer.comm.world.get_world`). CPU tensors travel over gloo even when
the main backend is NCCL. Results are new tensors unless the name ends in ``_``. Numerics
(Average, integers, scale factors, compression) are described in :mod:`hvd_trainer.comm.reduce`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hvd_trainer.comm.autograd import allreduce_with_grad, needs_autograd
from hvd_trainer.comm.compression import Compression, Compressor
from hvd_trainer.comm.errors import CommTypeError, CommValueError
from hvd_trainer.comm.ops import ReduceOp, op_or_average, to_reduce_op
from hvd_trainer.comm.process_set import ProcessSet, resolve_set
from hvd_trainer.comm.reduce import Reduction, signature, start_allreduce
from hvd_trainer.comm.world import World

__all__ = [
    "Handle",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "poll",
    "synchronize",
]


class Handle:
    """An asynchronous collective. Pass it to :func:`poll` or :func:`synchronize`.

    Calling it (``handle()``) is :func:`synchronize` too, which is how Horovod's
    ``sparse_allreduce_async`` handles are used.
    """

    __slots__ = ("_reductions", "_finish", "_result", "_done")

    def __init__(self, reductions: list[Reduction], finish: Callable[[], Any]) -> None:
        self._reductions = reductions
        self._finish = finish
        self._result: Any = None
        self._done = False

    def poll(self) -> bool:
        """True when the result is ready (never blocks)."""
        return self._done or all(r.poll() for r in self._reductions)

    def wait(self) -> Any:
        """Block until done and return the result (idempotent)."""
        if not self._done:
            for r in self._reductions:
                r.finish()
            self._result = self._finish()
            self._done = True
        return self._result

    finish = wait  # a Handle can be a part of another Handle
    __call__ = wait


def poll(handle: Handle) -> bool:
    """Whether the async collective behind ``handle`` has completed (never blocks)."""
    return _handle(handle).poll()


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle`` and return its result tensor (or list of tensors).

    Raises:
        CollectiveMismatchError, StallError, JoinedRankError: found while waiting.
    """
    return _handle(handle).wait()


def _handle(handle: Any) -> Handle:
    if not isinstance(handle, Handle):
        raise CommTypeError(
            f"expected a Handle from an *_async call, got {type(handle).__name__}. "
            "HINT: h = allreduce_async(t); result = synchronize(h)."
        )
    return handle


def _tensor(tensor: Any, fn: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise CommTypeError(f"{fn} expects a torch.Tensor, got {type(tensor).__name__}.")
    return tensor


def allreduce_async_(
    tensor: torch.Tensor,
    op: ReduceOp | str | None = None,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Compressor = Compression.none,
    process_set: ProcessSet | None = None,
    *,
    world: World | None = None,
    average: bool | None = None,
) -> Handle:
    """Start reducing ``tensor`` in place; :func:`synchronize` returns ``tensor``.

    Args:
        tensor: any shape and dtype, identical on every rank of the set.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` (or a string /
            ``torch.distributed.ReduceOp``). Integer ``Average`` is the exact integer sum
            divided by the set size, rounded toward zero, in the input dtype
            (``[1, 2] -> 1``, ``[-1, -2] -> -1``).
        name: label for error messages and the timeline.
        prescale_factor: multiply by this before the sum. postscale_factor: after it.
        compression: ``Compression.none`` / ``fp16`` / ``bf16`` (floating tensors only).
        process_set: the ranks to reduce over (this rank must be a member).
        average: Horovod's older flag (True: Average, False: Sum); not together with ``op``.

    Raises:
        CommTypeError: not a tensor; bool Average/Product. CommValueError: not a member.
        ValueError: both ``op`` and ``average``.
    """
    _tensor(tensor, "allreduce")
    # argument errors (e.g. Adasum) before any process group is needed
    rop = to_reduce_op(op_or_average(op, average))
    pset = resolve_set(process_set, world, "allreduce")
    target = tensor if tensor.is_contiguous() else tensor.contiguous()
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
    op: ReduceOp | str | None = None,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Compressor = Compression.none,
    process_set: ProcessSet | None = None,
    *,
    world: World | None = None,
    average: bool | None = None,
) -> Handle:
    """Out-of-place :func:`allreduce_async_`: ``tensor`` is unchanged; the result is new."""
    _tensor(tensor, "allreduce")
    op = op_or_average(op, average)
    return allreduce_async_(
        tensor.detach().clone(memory_format=torch.contiguous_format), op, name, prescale_factor,
        postscale_factor, compression, process_set, world=world,
    )


def allreduce_(
    tensor: torch.Tensor,
    op: ReduceOp | str | None = None,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Compressor = Compression.none,
    process_set: ProcessSet | None = None,
    *,
    world: World | None = None,
    average: bool | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over the set, in place, and return it. See :func:`allreduce_async_`."""
    op = op_or_average(op, average)
    return allreduce_async_(
        tensor, op, name, prescale_factor, postscale_factor, compression, process_set, world=world
    ).wait()


def allreduce(
    tensor: torch.Tensor,
    op: ReduceOp | str | None = None,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Compressor = Compression.none,
    process_set: ProcessSet | None = None,
    *,
    world: World | None = None,
    average: bool | None = None,
) -> torch.Tensor:
    """Return the reduction of ``tensor`` over the set; ``tensor`` is unchanged.

    Example:
        >>> hvd.allreduce(torch.tensor([float(hvd.rank())]))   # mean of the ranks

    Differentiable when ``tensor`` requires grad (backward: the same allreduce of the gradient,
    see :mod:`hvd_trainer.comm.autograd`); compression is not applied on that path.
    """
    op = op_or_average(op, average)
    if isinstance(tensor, torch.Tensor) and needs_autograd(tensor):
        return allreduce_with_grad(tensor, op, prescale_factor, postscale_factor, process_set, world)
    return allreduce_async(
        tensor, op, name, prescale_factor, postscale_factor, compression, process_set, world=world
    ).wait()


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp | str | None = None,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Compressor = Compression.none,
    process_set: ProcessSet | None = None,
    *,
    inplace: bool = False,
    world: World | None = None,
    average: bool | None = None,
) -> Handle:
    """Reduce a list of tensors as one fused operation per dtype (one collective each).

    The tensors are packed into one flat buffer per dtype (in list order), reduced, and
    unpacked. :func:`synchronize` returns the list of results (the inputs when ``inplace``).

    Raises:
        CommValueError: an empty list or tensors on different devices.
    """
    tensors = [_tensor(t, "grouped_allreduce") for t in tensors]
    if not tensors:
        raise CommValueError("grouped_allreduce got an empty list. HINT: pass at least one tensor.")
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:
        raise CommValueError(f"grouped_allreduce needs one device, got tensors on {devices}.")
    pset = resolve_set(process_set, world, "grouped_allreduce")
    rop = to_reduce_op(op_or_average(op, average))
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    parts = []
    for dtype, idx in by_dtype.items():
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        label = f"{name}.{str(dtype).replace('torch.', '')}" if name else None
        shapes = ("shapes", [list(tensors[i].shape) for i in idx])
        sig = signature("grouped_allreduce", label, flat, rop, prescale_factor, postscale_factor,
                        compression, (shapes,))
        red = start_allreduce(flat, op=rop, pset=pset, name=label, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor, compression=compression,
                              kind="grouped_allreduce", sig=sig)
        parts.append((idx, flat, red))

    @torch.no_grad()
    def finish() -> list[torch.Tensor]:
        out: list[torch.Tensor] = list(tensors)
        for idx, flat, _ in parts:
            for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx]), strict=True):
                view = piece.view(tensors[i].shape)
                if inplace:
                    tensors[i].copy_(view)
                else:
                    out[i] = view
        return out

    return Handle([red for _, _, red in parts], finish)


def grouped_allreduce(tensors: Sequence[torch.Tensor], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """Out-of-place grouped allreduce; same arguments as :func:`grouped_allreduce_async`."""
    return grouped_allreduce_async(tensors, *args, **kwargs).wait()


def grouped_allreduce_(tensors: Sequence[torch.Tensor], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """In-place grouped allreduce; returns ``tensors``."""
    return grouped_allreduce_async(tensors, *args, inplace=True, **kwargs).wait()

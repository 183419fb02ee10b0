"""The collectives of ZeRO, checked across ranks like every other: a bucket's reduce-scatter
and the exchange of updated parameters.

Transport (``torch.distributed``, gloo on CPU, NCCL on CUDA; torch 2.13): gloo implements
``reduce_scatter_single`` (``reduce_scatter_tensor`` before 2.13) natively (checked on CPU with
2 ranks), so a bucket's reduce-scatter moves ``(N-1)/N`` of the padded bucket per rank, half of
an allreduce. On a backend or torch version without it the bucket is allreduced whole and sliced
(a ``RuntimeError`` from the launch selects this once per process): the traffic of today's
allreduce and a full-size buffer, with the same result.

Scaling: gradients enter the bucket already multiplied by ``prescale/N`` (Average; fused with
the copy, see :mod:`hvd_trainer.comm.reduce.fusion`), so after the sum only ``postscale`` is applied,
to this rank's segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hvd_trainer.comm.base.errors import CommTypeError
from hvd_trainer.comm.ops.checks import Op, Signature
from hvd_trainer.comm.ops.compression import Compression, Compressor
from hvd_trainer.comm.ops.process_set import ProcessSet
from hvd_trainer.comm.zero.plan import BucketShard

__all__ = ["ScatterWork", "start_reducescatter", "exchange_parameters", "all_gather_flat"]

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_single`` (torch >= 2.13; the older name warns there) or ``all_gather_into_tensor``."""

_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter_single`` (torch >= 2.13; the older name warns there) or ``reduce_scatter_tensor``."""

_native_reduce_scatter = [True]
"""False once the backend refused ``reduce_scatter_tensor`` (then: allreduce and slice)."""


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None,
                    async_op: bool = False) -> object:
    """``out[r*k:(r+1)*k] = inp`` of rank ``r`` (``k = inp.numel()``), over ``group``."""
    return _all_gather_flat(out, inp, group=group, async_op=async_op)


@dataclass(slots=True)
class ScatterWork:
    """A bucket's reduce-scatter (or its allreduce fallback) in flight.

    :meth:`finish` waits and leaves this rank's reduced segment in :attr:`out`.
    """

    op: Op
    pset: ProcessSet
    wire: torch.Tensor
    wire_out: torch.Tensor | None
    out: torch.Tensor
    start: int
    post_factor: float
    compressed: bool
    finished: bool = False

    def poll(self) -> bool:
        return self.op.done or self.op.work is None or bool(self.op.work.is_completed())

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        if self.finished:
            return self.out
        self.pset.coordinator.wait(self.op)
        n = self.out.numel()
        # Native reduce-scatter: its output; allreduce (fallback or unbalanced bucket): the slice.
        src = self.wire_out if self.wire_out is not None else self.wire[self.start : self.start + n]
        if src.data_ptr() != self.out.data_ptr() or src.dtype != self.out.dtype:
            self.out.copy_(src)
        if self.post_factor != 1.0:
            self.out.mul_(self.post_factor)
        self.finished = True
        return self.out


@torch.no_grad()
def start_reducescatter(
    flat: torch.Tensor,
    shard: BucketShard,
    *,
    pset: ProcessSet,
    sig: Signature,
    post_factor: float = 1.0,
    compression: Compressor = Compression.none,
) -> ScatterWork:
    """Launch the sum of the bucket buffer ``flat`` over ``pset``, keeping this rank's segment.

    ``shard.scatter``: ``flat`` (``shard.buffer_numel`` elements, padded) is reduce-scattered;
    else it is allreduced whole. Either way :meth:`ScatterWork.finish` returns a new tensor of
    this rank's segment (``shard.seg_len[rank]`` elements: its gradients, then its used flags),
    multiplied by ``post_factor``.

    Args:
        flat: the bucket buffer, contiguous, already scaled by the pre-sum factor.
        shard: the bucket's layout (:class:`~hvd_trainer.comm.zero.plan.BucketShard`).
        pset: the ranks the bucket is sharded over; ``pset.rank()`` is the segment kept.
        sig: the collective's cross-rank signature (kind ``"reducescatter"``).
        post_factor: multiplier applied after the sum.
        compression: ``Compression.none`` or a plain cast (``bf16``); the fp16 compressor's
            global scale is not supported here.

    Raises:
        CommTypeError: a compressor that needs a global scale (``Compression.fp16``).
    """
    compression = Compression.resolve(compression, error=CommTypeError)
    if getattr(compression, "needs_global_scale", False):
        raise CommTypeError(
            f"compression={compression.name} needs a global scale, which ZeRO's reduce-scatter "
            "does not apply. HINT: use Compression.bf16 or Compression.none with zero_stage=2."
        )
    me = pset.rank()
    out = torch.empty(shard.seg_len[me], dtype=flat.dtype, device=flat.device)
    compress = compression.applies_to(flat)
    wire = flat.to(compression.wire_dtype) if compress else flat
    op = pset.coordinator.begin(sig, flat.numel() * flat.element_size())
    op.extra["device"] = flat.device.type
    group = pset.group_for(flat)
    wire_out = None
    start = shard.seg_start[me]
    if shard.scatter and _native_reduce_scatter[0]:
        wire_out = out if not compress else torch.empty(out.numel(), dtype=wire.dtype, device=wire.device)
        padded = wire_out if shard.chunk == out.numel() else torch.empty(
            shard.chunk, dtype=wire.dtype, device=wire.device)
        try:
            work = _reduce_scatter_flat(padded, wire, op=dist.ReduceOp.SUM, group=group,
                                        async_op=True)
        except RuntimeError:  # the backend has no reduce-scatter: allreduce and slice
            _native_reduce_scatter[0] = False
            wire_out = None
        else:
            wire_out = padded[: out.numel()]
    if wire_out is None:
        work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group, async_op=True)
    pset.coordinator.launched(op, work)
    return ScatterWork(op, pset, wire, wire_out, out, start, post_factor, compress)


def pack(shard: BucketShard, params: Sequence[torch.Tensor], rank: int,
         out: torch.Tensor) -> None:
    """Copy ``rank``'s parameters of the bucket into ``out`` (its segment, gradients part)."""
    pos = 0
    for owner, numel, p in zip(shard.owners, shard.numels, params, strict=True):
        if owner == rank:
            out[pos : pos + numel].copy_(p.detach().reshape(-1))
            pos += numel


@torch.no_grad()
def exchange_parameters(
    buckets: Sequence[tuple[BucketShard, Sequence[torch.Tensor], str]],
    *,
    pset: ProcessSet,
) -> None:
    """Give every rank the parameters their owners just updated.

    Per bucket (``(shard, params in shard order, label)``): a balanced bucket packs each
    owner's parameters into its segment of a padded buffer (``size * chunk`` elements) and
    allgathers it; an unbalanced one broadcasts each owner's segment from that owner. At most
    two buckets are in flight (two buffers of transient memory); the others wait their turn.
    """
    me = pset.rank()
    pending: list[tuple[list[Op], torch.Tensor, BucketShard, Sequence[torch.Tensor]]] = []
    for shard, params, label in buckets:
        pending.append(_launch_exchange(shard, params, label, pset, me))
        if len(pending) > 1:
            _finish_exchange(*pending.pop(0), pset, me)
    for item in pending:
        _finish_exchange(*item, pset, me)


def _launch_exchange(shard: BucketShard, params: Sequence[torch.Tensor], label: str,
                     pset: ProcessSet, me: int) -> tuple:
    dtype, device = params[0].dtype, params[0].device
    starts = shard.seg_start
    buf = torch.empty(shard.buffer_numel if shard.scatter else sum(shard.seg_numel),
                      dtype=dtype, device=device)
    group = pset.group_for(buf)
    works: list[Op] = []
    if shard.scatter:
        mine = buf[starts[me] : starts[me] + shard.chunk]
        pack(shard, params, me, mine)
        sig = Signature("allgather", f"zero.parameters[{label}]", (
            ("numel", shard.buffer_numel), ("dtype", str(dtype)), ("device", device.type)))
        op = pset.coordinator.begin(sig, buf.numel() * buf.element_size())
        op.extra["device"] = device.type
        pset.coordinator.launched(op, all_gather_flat(buf, mine.clone(), group, async_op=True))
        works.append(op)
        return works, buf, shard, params
    pos = 0
    for r in range(shard.size):
        n = shard.seg_numel[r]
        seg = buf[pos : pos + n]
        pos += n
        if not n:
            continue
        if r == me:
            pack(shard, params, me, seg)
        sig = Signature("broadcast", f"zero.parameters[{label}]#{r}", (
            ("numel", n), ("dtype", str(dtype)), ("device", device.type), ("root", r)))
        op = pset.coordinator.begin(sig, n * buf.element_size())
        op.extra["device"] = device.type
        pset.coordinator.launched(op, dist.broadcast(seg, src=pset.ranks[r], group=group, async_op=True))
        works.append(op)
    return works, buf, shard, params


def _finish_exchange(works: list[Op], buf: torch.Tensor, shard: BucketShard,
                     params: Sequence[torch.Tensor], pset: ProcessSet, me: int) -> None:
    for op in works:
        pset.coordinator.wait(op)
    # Segment starts in ``buf``: padded chunks for allgather, back to back for broadcasts.
    if shard.scatter:
        starts = list(shard.seg_start)
    else:
        starts, acc = [], 0
        for n in shard.seg_numel:
            starts.append(acc)
            acc += n
    for owner, numel, p in zip(shard.owners, shard.numels, params, strict=True):
        if owner != me:
            p.copy_(buf[starts[owner] : starts[owner] + numel].view_as(p))
        starts[owner] += numel

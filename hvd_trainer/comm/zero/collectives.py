"""The collectives of ZeRO, checked across ranks like every other: a bucket's reduce-scatter
and the exchange of updated parameters.

Transport (``torch.distributed``; torch 2.13). On CUDA (NCCL) a bucket is reduce-scattered with
``reduce_scatter_single`` and the updated parameters come back with ``all_gather_single``: each
moves ``(N-1)/N`` of the padded bucket per rank, together the traffic of one allreduce.

On CPU (gloo) both are done with point-to-point transfers instead, because gloo's own collectives
are not what their names promise there (``bench/zero_collectives.py``: 2 ranks on loopback, a
33.6 MB fp32 bucket, bytes counted on the ``lo`` interface): gloo's ``reduce_scatter`` moved as
many bytes as an allreduce (2.0x the bucket over both ranks, 55.8 ms against the allreduce's
26.6 ms) and its ``all_gather`` took 48.6 ms for 1.0x. Here the reduce-scatter is *direct*:
rank ``r`` sends segment ``j`` of its bucket to rank ``j`` (``isend``) and receives segment
``r`` from every other rank (``irecv``), then sums the ``N`` pieces in rank order: ``(N-1)/N``
of the bucket per rank, one round, every transfer launched at once (so it overlaps the backward
pass like a gloo allreduce); 36.8 ms and 1.0x in that measurement. The exchange sends each
owner's segment from its owner to every other rank (19.7 ms and 1.0x).

On a backend without ``reduce_scatter`` (a ``RuntimeError`` from the launch selects this once
per process) the bucket is allreduced whole and sliced: allreduce traffic, same result.

Scaling: gradients enter the bucket already multiplied by ``prescale/N`` (Average; fused with
the copy, see :mod:`hvd_trainer.comm.reduce.fusion`), so after the sum only ``postscale`` is applied,
to this rank's segment.
"""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hvd_trainer.comm.base.errors import CommTypeError
from hvd_trainer.comm.base.future_work import FutureWork
from hvd_trainer.comm.ops.checks import Op, Signature
from hvd_trainer.comm.ops.compression import Compression, Compressor
from hvd_trainer.comm.ops.process_set import ProcessSet
from hvd_trainer.comm.zero.plan import BucketShard

__all__ = ["ScatterWork", "P2PWork", "PendingExchange", "start_reducescatter", "exchange_parameters",
           "all_gather_flat", "uses_p2p"]

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_single`` (torch >= 2.13; the older name warns there) or ``all_gather_into_tensor``."""

_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter_single`` (torch >= 2.13; the older name warns there) or ``reduce_scatter_tensor``."""

_native_reduce_scatter = [True]
"""False once the backend refused ``reduce_scatter_tensor`` (then: allreduce and slice)."""


def uses_p2p(tensor: torch.Tensor) -> bool:
    """Whether ZeRO's collectives on ``tensor`` go point to point (CPU tensors: gloo, see the
    module docstring) rather than through the backend's reduce-scatter and allgather."""
    return tensor.device.type == "cpu"


class P2PWork(FutureWork):
    """Several point-to-point transfers of one collective as one ``Work``-like handle.

    gloo closes the connection when a point-to-point ``wait(timeout)`` times out ("Application
    timeout caused pair closure"), so the transfers are waited for, without a timeout of our
    own (the process group's timeout still applies), on a worker thread; ``wait(timeout)``
    waits for that thread (:class:`~hvd_trainer.comm.base.future_work.FutureWork`).
    """

    def __init__(self, works: Sequence[object]) -> None:
        super().__init__(_p2p_waiter().submit(_wait_all, list(works)), "ZeRO point-to-point transfers")


def _wait_all(works: list) -> None:
    for work in works:
        work.wait()


class _Waiter:
    """A daemon thread that runs submitted calls in order, each resolving a ``Future``.

    Not a ``ThreadPoolExecutor``: its threads are joined at interpreter exit, so a survivor
    that raised ``RankFailedError`` while a transfer with the dead rank was still being waited
    for would hang at exit until gloo's own timeout.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="hvd-zero-p2p", daemon=True).start()

    def submit(self, fn: Callable[..., None], *args: object) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(exc)


@functools.cache
def _p2p_waiter() -> _Waiter:
    """One thread per process that waits for point-to-point transfers in launch order."""
    return _Waiter()


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
    combine: Callable[[], None] | None = None
    """Run after the transfers (the direct reduce-scatter's sum of the received pieces)."""
    finished: bool = False
    wire_bytes: int = 0
    """Bytes this rank sends for the bucket: the direct reduce-scatter's segments to the others,
    a ring reduce-scatter's ``N-1`` padded chunks, or the allreduce fallback's ``2 (N-1)/N`` of
    the buffer (as :attr:`hvd_trainer.comm.GradientReducer.wire_bytes_sent` counts)."""

    def poll(self) -> bool:
        return self.op.done or self.op.work is None or bool(self.op.work.is_completed())

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        if self.finished:
            return self.out
        self.pset.coordinator.wait(self.op)
        if self.combine is not None:
            self.combine()
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
    size, item = pset.size(), wire.element_size()
    if shard.scatter and uses_p2p(flat) and size > 1:
        work, combine = _direct_reduce_scatter(wire, out, shard, pset, group)
        wire_out = out
        pset.coordinator.launched(op, work)
        sent = sum(n for j, n in enumerate(shard.seg_len) if j != me) * item
        return ScatterWork(op, pset, wire, wire_out, out, start, post_factor, compress, combine,
                           wire_bytes=sent)
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
        sent = 2 * (size - 1) * wire.numel() * item // size
    else:
        sent = (size - 1) * shard.chunk * item
    pset.coordinator.launched(op, work)
    return ScatterWork(op, pset, wire, wire_out, out, start, post_factor, compress, wire_bytes=sent)


def _direct_reduce_scatter(
    wire: torch.Tensor, out: torch.Tensor, shard: BucketShard, pset: ProcessSet,
    group: dist.ProcessGroup | None,
) -> tuple[P2PWork, Callable[[], None]]:
    """Send segment ``j`` of the padded bucket ``wire`` to rank ``j``, receive this rank's
    segment from every other rank; the returned callback sums the ``N`` pieces in rank order
    into ``out`` (``seg_len[rank]`` elements, its dtype)."""
    me, chunk, lens = pset.rank(), shard.chunk, shard.seg_len
    n = lens[me]
    works, pieces = [], []
    for j in range(shard.size):
        if j == me:
            pieces.append(wire[me * chunk : me * chunk + n])
            continue
        if lens[j]:
            works.append(dist.isend(wire[j * chunk : j * chunk + lens[j]], dst=pset.ranks[j], group=group))
        if n:
            buf = torch.empty(n, dtype=wire.dtype, device=wire.device)
            works.append(dist.irecv(buf, src=pset.ranks[j], group=group))
            pieces.append(buf)

    def combine() -> None:
        if len(pieces) == 1:
            out.copy_(pieces[0])
            return
        torch.add(pieces[0], pieces[1], out=out)
        for piece in pieces[2:]:
            out.add_(piece)

    return P2PWork(works), combine


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
    defer: bool = False,
) -> PendingExchange | None:
    """Give every rank the parameters their owners just updated.

    Per bucket (``(shard, params in shard order, label)``): a balanced bucket packs each
    owner's parameters into its segment of a padded buffer (``size * chunk`` elements) and
    allgathers it (CUDA); on CPU, and for an unbalanced bucket, each owner's segment is broadcast
    from its owner (a segment of one contiguous parameter straight from and into the parameter).
    At most two buckets that need a packing buffer are in flight (two buffers of transient
    memory); buckets sent in place add none and are all launched at once, so both directions
    of a link stay busy.

    ``defer=True``: every bucket is launched, in the order given, and a :class:`PendingExchange`
    is returned that finishes them on demand (overlapping the exchange with what runs next);
    until it has finished a bucket, that bucket's parameters of other owners hold their old
    values (or a partly received new one). Transient memory: every packing buffer at once.
    """
    me = pset.rank()
    if defer:
        return PendingExchange([_launch_exchange(shard, params, label, pset, me)
                                for shard, params, label in buckets], pset, me)
    pending: list[tuple] = []
    buffered = 0  # buckets in ``pending`` that hold a transient buffer
    for shard, params, label in buckets:
        item = _launch_exchange(shard, params, label, pset, me)
        pending.append(item)
        buffered += item[1].numel() > 0
        while buffered > 1:  # finish in launch order until one buffer is left
            done = pending.pop(0)
            buffered -= done[1].numel() > 0
            _finish_exchange(*done, pset, me)
    for item in pending:
        _finish_exchange(*item, pset, me)
    return None


class PendingExchange:
    """Parameter exchanges launched by ``exchange_parameters(..., defer=True)``, finished in
    launch order on demand."""

    def __init__(self, items: list[tuple], pset: ProcessSet, me: int) -> None:
        self._items = items
        self._pset, self._me = pset, me
        self._done = 0
        self._position = {id(p): k for k, item in enumerate(items) for p in item[3]}

    @property
    def finished(self) -> bool:
        return self._done == len(self._items)

    def unfinished(self) -> list[torch.Tensor]:
        """Parameters of the buckets not finished yet (every owner's)."""
        return [p for item in self._items[self._done :] for p in item[3]]

    @torch.no_grad()
    def finish_for(self, params: Iterable[torch.Tensor]) -> None:
        """Finish every bucket up to the last one holding any of ``params`` (launch order)."""
        last = max((self._position.get(id(p), -1) for p in params), default=-1)
        while self._done <= last:
            _finish_exchange(*self._items[self._done], self._pset, self._me)
            self._done += 1

    @torch.no_grad()
    def finish(self) -> None:
        """Finish every bucket."""
        while self._done < len(self._items):
            _finish_exchange(*self._items[self._done], self._pset, self._me)
            self._done += 1


def _launch_exchange(shard: BucketShard, params: Sequence[torch.Tensor], label: str,
                     pset: ProcessSet, me: int) -> tuple:
    dtype, device = params[0].dtype, params[0].device
    gather = shard.scatter and not uses_p2p(params[0])
    works: list[Op] = []
    if gather:
        buf = torch.empty(shard.buffer_numel, dtype=dtype, device=device)
        mine = torch.empty(shard.chunk, dtype=dtype, device=device)
        pack(shard, params, me, mine)
        sig = Signature("allgather", f"zero.parameters[{label}]", (
            ("numel", shard.buffer_numel), ("dtype", str(dtype)), ("device", device.type)))
        op = pset.coordinator.begin(sig, buf.numel() * buf.element_size())
        op.extra["device"] = device.type
        pset.coordinator.launched(op, all_gather_flat(buf, mine, pset.group_for(buf), async_op=True))
        works.append(op)
        return works, buf, shard, params, gather, frozenset()
    # One broadcast per owner. An owner whose segment is one contiguous parameter broadcasts
    # the parameter itself (received in place: no copy on either side); the others' segments
    # are packed into (and unpacked from) one buffer, back to back.
    owned: list[list[torch.Tensor]] = [[] for _ in range(shard.size)]
    for owner, p in zip(shard.owners, params, strict=True):
        owned[owner].append(p)
    direct = frozenset(r for r in range(shard.size)
                       if len(owned[r]) == 1 and owned[r][0].is_contiguous())
    buf = torch.empty(sum(n for r, n in enumerate(shard.seg_numel) if r not in direct),
                      dtype=dtype, device=device)
    group = pset.group_for(params[0])
    pos = 0
    for r in range(shard.size):
        n = shard.seg_numel[r]
        if not n:
            continue
        if r in direct:
            seg = owned[r][0].detach().view(-1)
        else:
            seg = buf[pos : pos + n]
            pos += n
            if r == me:
                pack(shard, params, me, seg)
        sig = Signature("broadcast", f"zero.parameters[{label}]#{r}", (
            ("numel", n), ("dtype", str(dtype)), ("device", device.type), ("root", r)))
        op = pset.coordinator.begin(sig, n * seg.element_size())
        op.extra["device"] = device.type
        if uses_p2p(seg):  # the owner sends to every other rank directly (see the module docstring)
            if r == me:
                sent = [dist.isend(seg, dst=pset.ranks[q], group=group) for q in range(shard.size) if q != me]
            else:
                sent = [dist.irecv(seg, src=pset.ranks[r], group=group)]
            work = P2PWork(sent)
        else:
            work = dist.broadcast(seg, src=pset.ranks[r], group=group, async_op=True)
        pset.coordinator.launched(op, work)
        works.append(op)
    return works, buf, shard, params, gather, direct


def _finish_exchange(works: list[Op], buf: torch.Tensor, shard: BucketShard,
                     params: Sequence[torch.Tensor], gather: bool, direct: frozenset[int],
                     pset: ProcessSet, me: int) -> None:
    for op in works:
        pset.coordinator.wait(op)
    # Segment starts in ``buf``: padded chunks for allgather, back to back for broadcasts
    # (owners in ``direct`` were received in place and have no segment there).
    if gather:
        starts = list(shard.seg_start)
    else:
        starts, acc = [], 0
        for r, n in enumerate(shard.seg_numel):
            starts.append(acc)
            acc += 0 if r in direct else n
    for owner, numel, p in zip(shard.owners, shard.numels, params, strict=True):
        if owner != me and owner not in direct:
            p.copy_(buf[starts[owner] : starts[owner] + numel].view_as(p))
        starts[owner] += numel

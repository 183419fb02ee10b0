"""ZeRO stage 2's gradient reducer: the fused buckets, reduce-scattered to the parameters' owners.

Same hooks, bucket order, overlap with backward, pre-sum scaling and cross-rank checks as
:class:`~hvd_trainer.comm.reduce.fusion.GradientReducer` (it is a subclass); what differs is the
bucket's buffer and its collective:

1. Each bucket's buffer is laid out by owner (:mod:`hvd_trainer.comm.zero.plan`): segment ``r``
   holds rank ``r``'s gradients then their "used" flags, segments padded to equal length.
2. A complete bucket goes to :func:`reducescatter_hook` (the reducer's one bucket hook, see
   :mod:`hvd_trainer.comm.reduce.bucket_hooks`) instead of the allreduce: a reduce-scatter (or,
   for a bucket the plan found unbalanced, an allreduce of the unpadded buffer), so each rank
   receives only the sum of its own segment.
3. :meth:`ShardedGradientReducer.wait` finishes them; afterwards a parameter this rank owns has
   ``.grad`` = the averaged gradient (a view into a segment-sized tensor), every other
   parameter ``.grad = None``, and the bucket buffers are freed (made again when the
   bucket's first gradient arrives in the next backward).

With a plan by elements (``split=True``) a parameter may be cut between segments: its gradient
is gathered during backward in a staging tensor of its own (not a view of the bucket, whose
segments hold the pieces apart), copied piece by piece into the segments at the launch; after
``wait()`` its ``.grad`` is ``None`` and the averaged pieces this rank owns are in
:attr:`ShardedGradientReducer.piece_grads`.

Memory: after ``wait()`` a rank holds ``1/N`` of the gradient bytes (within one parameter, see
the plan's bound) plus its used flags. During backward the buckets hold the full gradient as
in stage 1 (they are freed together at ``wait()``), and with ``no_sync``/accumulation passes
the local gradients are full-size until the synchronising pass.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence

import torch

from hvd_trainer.comm.ops.compression import Compression, Compressor
from hvd_trainer.comm.ops.ops import ReduceOp, reject_adasum, to_reduce_op
from hvd_trainer.comm.ops.process_set import ProcessSet, resolve_set
from hvd_trainer.comm.ops.reduce import signature
from hvd_trainer.comm.reduce.bucket_hooks import HookState
from hvd_trainer.comm.reduce.fusion import (
    _FUSE_SCALE_BYTES,
    FusionConfig,
    GradientReducer,
    _assign_buckets,
    _Bucket,
    link_paced_config,
)
from hvd_trainer.comm.reduce.link_probe import LinkEstimate
from hvd_trainer.comm.world.world import World
from hvd_trainer.comm.zero.collectives import ScatterWork, start_reducescatter
from hvd_trainer.comm.zero.plan import BucketShard, ShardPlan, plan_shards

__all__ = ["ShardedGradientReducer", "plan_parameters", "reducescatter_hook", "stage2_config"]


def stage2_config(
    config: FusionConfig | None, world: World, process_set: ProcessSet | None, device: torch.device | None,
) -> tuple[FusionConfig, LinkEstimate | None]:
    """The bucket config a stage-2 layout is planned with: ``config`` with autotune, link
    awareness and hierarchical buckets off, its caps first lowered to the measured link when
    ``config.link_aware`` and the ranks span several hosts (as the plain reducer does, so a slow
    link's reduce-scatter starts early in backward). Probing is a collective over the set's
    ranks; a rank outside the set does not probe. Returns the config and the link (or None)."""
    config = config or FusionConfig()
    link = None
    included = process_set is None or process_set.included()
    size = process_set.size() if process_set is not None else world.size
    if config.link_aware and included and device is not None and size > 1 and world.cross_size > 1:
        config, link = link_paced_config(config, resolve_set(process_set, world, "ZeRO stage 2"), device)
    return dataclasses.replace(config, autotune=None, link_aware=False, hierarchical=False), link


def plan_parameters(
    named: Sequence[tuple[str, torch.Tensor]], config: FusionConfig | None, size: int,
    *, split: bool = False,
) -> ShardPlan:
    """The shard plan of ``named`` (trainable parameters, in registration order) over ``size``
    ranks, on the buckets the reducer makes with ``config``; ``split``: by elements (see
    :func:`~hvd_trainer.comm.zero.plan.plan_shards`), cutting only contiguous parameters (a
    piece is a view of ``param.view(-1)``)."""
    layout = _assign_buckets(named, config or FusionConfig(autotune=None))
    return plan_shards(layout, [p.numel() for _, p in named], [p.element_size() for _, p in named],
                       size, split=split, cuttable=[p.is_contiguous() for _, p in named])


class _ShardedBucket(_Bucket):
    """A bucket whose buffer is laid out by owner (see :class:`BucketShard`).

    Positions (``params``, ``views``, ``ready``, ...) are parameters, each once, as in the base
    class; ``entry_pos`` maps each entry of the shard (a parameter or a piece) to its position.
    A parameter cut into pieces (``cut``) has a staging tensor as its view."""

    __slots__ = ("shard", "flag_index", "out", "dtype", "device", "entry_pos", "cut")

    def __init__(self, index: int, names: list[str], params: list[torch.Tensor],
                 shard: BucketShard, entry_pos: list[int]) -> None:
        # Not _Bucket.__init__: the layout differs (segments by owner, flags inside them).
        self.order, self.names, self.params, self.shard = index, names, params, shard
        self.last, self.hook_buffer = False, None
        self.entry_pos = entry_pos
        self.cut = {entry_pos[e] for e, n in enumerate(shard.numels) if n != params[entry_pos[e]].numel()}
        self.offsets = list(shard.offsets())
        self.grad_numel = sum(p.numel() for p in params)
        self.dtype, self.device = params[0].dtype, params[0].device
        self.flag_index = torch.tensor(shard.flag_offsets(), dtype=torch.long, device=self.device)
        self.used = None
        self.used_flags = [1.0] * len(params)
        self.ready = [False] * len(params)
        self.pending = len(params)
        self.adopted = [False] * len(params)
        self.fuse_scale = self.grad_numel * params[0].element_size() >= _FUSE_SCALE_BYTES * len(params)
        self.work: ScatterWork | None = None  # type: ignore[assignment]
        self.sig = None
        self.out: torch.Tensor | None = None
        self.flat: torch.Tensor | None = None  # type: ignore[assignment]
        self.views: list[torch.Tensor] | None = None  # type: ignore[assignment]
        self.materialize()

    @property
    def nbytes(self) -> int:
        return self.grad_numel * torch.empty((), dtype=self.dtype).element_size()

    def materialize(self) -> None:
        """Make the buffer and the gradient views if they were freed.

        Not zeroed (no memset pass): every view is written before the launch (a gradient copied
        in, or zeros for a parameter without one) and the flags at the launch; the padding after
        a segment is summed but never read."""
        if self.flat is not None:
            return
        self.flat = torch.empty(self.shard.buffer_numel, dtype=self.dtype, device=self.device)
        views: list[torch.Tensor | None] = [None] * len(self.params)
        for e, pos in enumerate(self.entry_pos):
            p = self.params[pos]
            if pos in self.cut:
                views[pos] = torch.empty_like(p, memory_format=torch.contiguous_format)
            elif views[pos] is None:
                views[pos] = self.flat[self.offsets[e] : self.offsets[e] + p.numel()].view_as(p)
        self.views = views  # type: ignore[assignment]

    def seal(self) -> None:
        """At the launch: copy the staged gradients of cut parameters into their pieces' places
        and write the used flags into the segments."""
        assert self.flat is not None and self.views is not None
        shard = self.shard
        for e, pos in enumerate(self.entry_pos):
            if pos in self.cut:
                start, numel, at = shard.starts[e], shard.numels[e], self.offsets[e]
                self.flat[at : at + numel].copy_(self.views[pos].reshape(-1)[start : start + numel])
        if all(self.used_flags):
            self.flat.index_fill_(0, self.flag_index, 1)
        else:  # rare (unused parameters): a small synchronous copy
            flags = torch.tensor([self.used_flags[pos] for pos in self.entry_pos],
                                 dtype=self.dtype, device=self.device)
            self.flat.index_copy_(0, self.flag_index, flags)

    def release(self) -> None:
        """Free the buffer (the full gradients of the bucket)."""
        self.flat = None
        self.views = None


def reducescatter_hook(state: HookState, bucket: _ShardedBucket) -> ScatterWork:
    """ZeRO stage 2's bucket hook: reduce-scatter the bucket buffer (laid out by owner) so this
    rank keeps the sum of its own segment (``bucket.out`` once finished), times
    ``postscale_factor``; see :func:`~hvd_trainer.comm.zero.collectives.start_reducescatter`."""
    assert bucket.flat is not None and bucket.sig is not None
    work = start_reducescatter(bucket.flat, bucket.shard, pset=state.process_set, sig=bucket.sig,
                               post_factor=state.postscale_factor, compression=state.compression)
    state.bytes_sent += work.wire_bytes
    bucket.out = work.out  # the reducer drops .work at the end of wait()
    return work


class ShardedGradientReducer(GradientReducer):
    """Reduce-scatter the gradients of ``named_parameters`` to their owners while backward runs.

    Example:
        >>> reducer = ShardedGradientReducer(model.named_parameters(), world=hvd_trainer.comm.init())
        >>> loss.backward()
        >>> reducer.wait()    # owned p.grad: averaged over ranks; the others: None
        >>> owned = reducer.plan.owned(reducer.process_set.rank())

    Args:
        named_parameters, world, config, op, prescale_factor, postscale_factor, process_set,
        register_hooks:
            as :class:`~hvd_trainer.comm.reduce.fusion.GradientReducer`. ``config.autotune`` is
            not supported (the layout fixes the ownership; turned off with a warning), nor are
            ``link_aware`` and ``hierarchical`` (off: the caps given are used as they are).
        compression: ``Compression.none`` or ``Compression.bf16``.
        plan: the ownership to reduce-scatter to (the optimizer's, so both follow one plan);
            ``None``: planned here by whole parameters. It must have been planned over
            ``named_parameters`` (trainable ones) with this reducer's bucket config
            (:func:`stage2_config`) and the process set's size.
        split: without ``plan``, plan by elements (only for an optimizer whose update is per
            element: :func:`~hvd_trainer.comm.zero.pieces.per_element` says).

    Raises:
        ValueError: as the base class; a ``plan`` that does not cover these parameters.
    """

    def __init__(
        self,
        named_parameters: Sequence[tuple[str, torch.Tensor]] | Iterator[tuple[str, torch.Tensor]],
        *,
        world: World,
        config: FusionConfig | None = None,
        op: ReduceOp | str | None = None,
        compression: Compressor = Compression.none,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        process_set: ProcessSet | None = None,
        plan: ShardPlan | None = None,
        split: bool = False,
        register_hooks: bool = True,
    ) -> None:
        reject_adasum(to_reduce_op(op), "ZeRO stage 2's reduce-scatter")
        config = config or FusionConfig()
        if config.autotune is not None:
            warnings.warn("ZeRO stage 2 keeps one bucket layout (it fixes which rank owns which "
                          "parameter); autotune is off for it.", stacklevel=2)
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        # The layout is planned before the base class runs, so nothing may change it there:
        # link pacing (several hosts) happens here, first; buckets are reduce-scattered, never
        # hierarchically allreduced.
        config, link = stage2_config(config, world, process_set, named[0][1].device if named else None)
        size = process_set.size() if process_set is not None else world.size
        if plan is not None and (len(plan.owner) != len(named) or plan.size != size):
            raise ValueError(f"the shard plan covers {len(plan.owner)} parameters over {plan.size} "
                             f"ranks, the reducer {len(named)} over {size}. HINT: plan with the "
                             "reducer's trainable parameters and process set.")
        self.plan = plan if plan is not None else plan_parameters(named, config, size, split=split)
        self.piece_grads: dict[tuple[int, int], torch.Tensor] = {}
        """After :meth:`wait`, with a plan by elements: the averaged gradient of each piece this
        rank owns, by ``(id(parameter), start)`` (1-D, the piece's elements)."""
        self._index = {id(p): i for i, (_, p) in enumerate(named)}
        self._plan_named = named
        self._check_unused = False
        super().__init__(named, world=world, config=config, op=op, compression=compression,
                         prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                         process_set=process_set, hook=reducescatter_hook,
                         register_hooks=register_hooks)
        self.link = link

    def _new_bucket(self, index: int, names: list[str], params: list[torch.Tensor]) -> _Bucket:
        shard = self.plan.buckets[index]
        named = self._plan_named
        unique = list(dict.fromkeys(shard.params))  # positions: parameters in layout order
        if sorted(unique) != sorted(self._index[id(p)] for p in params):
            raise ValueError(
                f"the shard plan's bucket {index} does not hold the reducer's parameters: the "
                "buckets were planned on the parameters' sizes and dtypes when the optimizer was "
                "wrapped, and they differ now. HINT: convert the model (model.to(dtype), "
                "model.to(device)) before wrapping the optimizer.")
        where = {i: pos for pos, i in enumerate(unique)}
        return _ShardedBucket(index, [named[i][0] for i in unique], [named[i][1] for i in unique],
                              shard, [where[i] for i in shard.params])

    def _bucket_signature(self, bucket: _Bucket):  # type: ignore[override]
        assert isinstance(bucket, _ShardedBucket) and bucket.flat is not None
        shard = bucket.shard
        layout = [f"{bucket.names[pos]}:{list(bucket.params[pos].shape)}"
                  + (f"[{shard.starts[e]}:{shard.starts[e] + shard.numels[e]}]" if pos in bucket.cut else "")
                  for e, pos in enumerate(bucket.entry_pos)]
        extra = (("bucket", f"{bucket.order + 1} of {len(self._buckets)}"), ("parameters", layout),
                 ("owners", list(bucket.shard.owners)), ("scatter", bucket.shard.scatter))
        return signature(
            "reducescatter", f"zero.gradients[{bucket.names[0]}..{bucket.names[-1]}]", bucket.flat,
            self.op, self.prescale_factor, self.postscale_factor, self.compression, extra,
        )

    @property
    def owned_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, parameter)`` this rank owns (empty outside the process set)."""
        if self.process_set is None:
            return []
        return [self._plan_named[i] for i in self.plan.owned(self.process_set.rank())]

    # -- hooks --------------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if self.require_sync:
            bucket = self._slot[id(param)][0]
            assert isinstance(bucket, _ShardedBucket)
            bucket.materialize()
        super()._on_grad_ready(param)

    def _drop_globally_unused(self) -> None:
        self._check_unused = True  # done in _keep_own_segment, from this rank's flags

    # -- wait ---------------------------------------------------------------------------------
    def wait(self) -> None:
        """Finish the reduce-scatter of this step: owned ``.grad`` averaged, others ``None``,
        bucket buffers freed. No-op outside the process set."""
        if not self.active:
            return
        for bucket in self._buckets:
            assert isinstance(bucket, _ShardedBucket)
            bucket.materialize()  # a bucket without any gradient this step still takes part
        super().wait()
        self._keep_own_segment()

    def _keep_own_segment(self) -> None:
        """Point owned gradients at this rank's reduced segment, drop the others, free buffers."""
        assert self.process_set is not None
        me = self.process_set.rank()
        check, self._check_unused = self._check_unused, False
        self.piece_grads = {}
        for bucket in self._buckets:
            assert isinstance(bucket, _ShardedBucket) and bucket.views is not None
            out, shard = bucket.out, bucket.shard
            assert out is not None
            # Used flags follow the gradients in the segment; 0 = no rank produced a gradient.
            flags = out[shard.seg_numel[me] :].tolist() if check else None
            adopted = [p.grad is not None and p.grad.data_ptr() == v.data_ptr()
                       for p, v in zip(bucket.params, bucket.views, strict=True)]
            at = k = 0
            for e, (pos, owner) in enumerate(zip(bucket.entry_pos, shard.owners, strict=True)):
                param, n = bucket.params[pos], shard.numels[e]
                if adopted[pos] and (owner != me or pos in bucket.cut):
                    param.grad = None
                if owner != me:
                    continue
                if adopted[pos]:
                    unused = flags is not None and flags[k] == 0
                    if pos not in bucket.cut:
                        param.grad = None if unused else out[at : at + n].view_as(param)
                    elif not unused:
                        self.piece_grads[(id(param), shard.starts[e])] = out[at : at + n]
                at, k = at + n, k + 1
            bucket.out = None
            bucket.release()

    @property
    def grad_bytes_held(self) -> int:
        """Bytes of ``.grad`` tensors this rank holds for the reducer's parameters now
        (``numel * element_size`` of each non-``None`` gradient)."""
        return sum(p.grad.numel() * p.grad.element_size() for _, p in self._plan_named
                   if p.grad is not None) + sum(g.numel() * g.element_size()
                                                for g in self.piece_grads.values())

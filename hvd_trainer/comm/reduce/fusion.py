"""Hook-driven, bucketed gradient allreduce (Horovod's Tensor Fusion, DDP's buckets).

Algorithm:
1. Parameters are grouped by (device, dtype) and assigned to buckets in reverse registration
   order (backward produces gradients roughly last-layer-first, as DDP assumes). The first
   bucket is capped at ``first_bucket_bytes`` so communication starts early in backward; the
   others at ``fusion_threshold_bytes``.
2. Each bucket owns one flat buffer; every parameter's ``.grad`` becomes a view into it, so a
   bucket is reduced with one collective and the result needs no copy back.
3. ``register_post_accumulate_grad_hook`` marks a parameter ready; when a bucket is complete
   it goes to the reducer's bucket hook (:mod:`hvd_trainer.comm.reduce.bucket_hooks`: the
   allreduce, a compressed or hierarchical one, ZeRO's reduce-scatter, or a user's DDP-style
   communication hook), which launches it asynchronously. Buckets launch strictly in order so
   every rank issues the same sequence of collectives.
4. :meth:`GradientReducer.wait` launches whatever is left (a parameter that got no gradient on
   this rank contributes zeros, so no rank hangs) and waits on all work. ``prescale_factor``
   and, for ``Average``, ``1/N`` are applied to each gradient as it enters its bucket (fused
   with the copy, and before the sum so fp16 cannot overflow); ``postscale_factor`` after.
5. Each bucket launch is a checked collective: its signature carries the bucket's layout
   (parameter names and shapes), so ranks whose layouts differ (e.g. a parameter that requires
   grad on one rank only) get :class:`~hvd_trainer.comm.base.errors.CollectiveMismatchError` naming
   the parameter, on the first step; later steps hit the signature cache.
6. With ``FusionConfig(autotune=...)`` (or ``HOROVOD_AUTOTUNE=1``) the reducer tries candidate
   layouts during the first steps (:mod:`hvd_trainer.comm.reduce.autotune`): it times the interval
   between consecutive :meth:`GradientReducer.wait` calls (one training step), agrees on each
   sample with one 4-byte allreduce (the slowest rank's median), and every rank re-buckets at the
   same step; then it keeps the fastest layout. Re-bucketing copies the current gradients into
   the new buffers, so results equal a fixed layout's up to summation order.

Copies: every ``.grad`` *is* its bucket view by the end of backward, and the reduction happens in
the bucket, so nothing is copied out. When ``.grad`` was ``None`` (``zero_grad()``, whose default
is ``set_to_none=True``), autograd hands over a fresh tensor, and the reducer copies it in *scaled
by the pre-sum factor*: the copy DDP's ``gradient_as_bucket_view`` makes, with the division by N
folded in, so no pass divides the reduced bucket afterwards. A bucket of large tensors (at least
``_FUSE_SCALE_BYTES`` each on average) copies each gradient as its hook fires, with ``torch.mul(g,
f, out=view)`` (one memory pass, nothing held); a bucket of many small ones copies all of them
when its last gradient is ready, with one ``torch._foreach_copy_`` and one ``torch._foreach_mul_``
(one dispatch instead of one per tensor). A callback queued on the autograd engine copies in what
is ready in buckets that did not complete (a parameter unused on this rank) at the end of
backward, so a ``.grad`` reference taken after ``backward()`` is the view that :meth:`wait`
reduces in place, as in Horovod. With ``zero_grad(set_to_none=False)`` autograd accumulates into
the view in place and the reducer only scales it. Re-pointing ``.grad`` at a zeroed view before
backward (a tensor pre-hook) was measured too: memset + in-place add cost as much as the copy and
need one more pass for the scale, so it is not used. Sparse gradients (``Embedding(sparse=True)``)
are densified into their bucket.

Hook cost: for small tensors the per-parameter hook only marks the parameter ready and counts down
its bucket (``bench/hook_overhead.py``: 14.1 us per parameter per step when each hook copied its own
gradient, 5.7-6.0 us with the per-bucket copy on a quiet machine, of which ~1.8 us is the one
bucket's allreduce itself, 101-122 us in a world of one). Autograd has no hook that fires once for a set
of leaves: ``register_multi_grad_hook`` registers one Python hook per tensor as well, and fires
before accumulation into ``.grad``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hvd_trainer.comm.base.config import (
    default_fusion_threshold_bytes,
    fusion_threshold_is_set,
    hierarchical_allreduce_env,
)
from hvd_trainer.comm.base.errors import CommTypeError
from hvd_trainer.comm.ops.checks import Signature
from hvd_trainer.comm.ops.compression import Compression, Compressor
from hvd_trainer.comm.ops.ops import ReduceOp, to_reduce_op
from hvd_trainer.comm.ops.process_set import ProcessSet, resolve_set
from hvd_trainer.comm.ops.reduce import signature, start_allreduce
from hvd_trainer.comm.reduce.autotune import (
    AutotuneConfig,
    Autotuner,
    Candidate,
    candidate_thresholds,
    resolve_autotune,
)
from hvd_trainer.comm.reduce.bucket_hooks import (
    BucketHook,
    BucketWork,
    HookState,
    builtin_hook,
    hierarchical_launch,
    refuse_with_hook,
    user_hook,
)
from hvd_trainer.comm.reduce.compressed.reductions import FeedbackState, rename_feedback
from hvd_trainer.comm.reduce.hierarchical import HostTopology, build_topology
from hvd_trainer.comm.reduce.link_probe import LinkEstimate, bucket_cap_bytes, probe_link, time_paths
from hvd_trainer.comm.world.world import World

_log = logging.getLogger(__name__)

__all__ = ["FusionConfig", "GradientReducer", "LINK_MIN_BUCKET_BYTES", "default_fusion_threshold_bytes",
           "link_paced_config"]

_MIB = 1024 * 1024
_FUSE_SCALE_BYTES = 256 * 1024
"""Mean gradient size per parameter (bytes) from which a bucket copies each gradient with its own
``torch.mul(..., out=view)`` (one memory pass) instead of one ``torch._foreach_copy_`` of the whole
bucket plus one in-place scale (two passes, but one dispatch instead of one per parameter). On this
2-core machine the per-tensor ``mul`` costs ~3.4 us of dispatch, the extra pass ~13 ns per KiB."""


@dataclass(kw_only=True, slots=True)
class FusionConfig:
    """How gradients are packed into buckets."""

    fusion_threshold_bytes: int | None = None
    """Cap of one bucket, bytes. 0 puts every tensor in its own bucket (no fusion). Default
    (``None``): ``HOROVOD_FUSION_THRESHOLD`` or 16 MiB (measured, see
    ``config.DEFAULT_FUSION_THRESHOLD_BYTES``), lowered to the link's pace when ``link_aware``."""
    first_bucket_bytes: int | None = None
    """Cap of the first bucket (the last layers' gradients), bytes, so communication starts
    early in backward. Default (``None``): 1 MiB."""
    autotune: AutotuneConfig | bool | None = field(default_factory=AutotuneConfig.from_env)
    """Search the bucket layout during the first steps (:mod:`hvd_trainer.comm.reduce.autotune`):
    an ``AutotuneConfig``, ``True`` (on, settings from ``HOROVOD_AUTOTUNE_*``), ``False``/``None``
    (the layout above, fixed). Default: from ``HOROVOD_AUTOTUNE*``. Stored resolved."""
    link_aware: bool | None = None
    """Size the buckets by the measured link when the ranks span several hosts
    (:mod:`hvd_trainer.comm.reduce.link_probe`): each bucket's cap becomes about ``bucket_seconds`` on the
    wire (at least ``LINK_MIN_BUCKET_BYTES``, at most the caps above), so a slow link starts early
    in backward and stays busy. ``None`` (default): on unless a cap was given (an argument or
    ``HOROVOD_FUSION_THRESHOLD``) or autotune is on. On one host it never applies. Stored
    resolved."""
    bucket_seconds: float = 0.05
    """With ``link_aware``: the time one bucket should take on the wire, seconds."""
    hierarchical: bool | None = field(default_factory=hierarchical_allreduce_env)
    """Reduce buckets hierarchically (:mod:`hvd_trainer.comm.reduce.hierarchical`: inside each
    host, then across hosts) when the ranks span several hosts with several ranks each and the
    reducer runs over all ranks. ``True``/``False`` force it on/off; ``None`` (default, unless
    ``HOROVOD_HIERARCHICAL_ALLREDUCE`` is set): with ``link_aware``, the faster of flat and
    hierarchical in a measured comparison (a 256 KiB allreduce each way, ~5% margin for flat)."""

    def __post_init__(self) -> None:
        chosen = (self.fusion_threshold_bytes is not None or self.first_bucket_bytes is not None
                  or fusion_threshold_is_set())
        if self.fusion_threshold_bytes is None:
            self.fusion_threshold_bytes = default_fusion_threshold_bytes()
        if self.first_bucket_bytes is None:
            self.first_bucket_bytes = 1 * _MIB
        if self.fusion_threshold_bytes < 0:
            raise ValueError(
                f"fusion_threshold_bytes={self.fusion_threshold_bytes} must be >= 0."
            )
        if self.first_bucket_bytes < 0:
            raise ValueError(f"first_bucket_bytes={self.first_bucket_bytes} must be >= 0.")
        if not self.bucket_seconds > 0:
            raise ValueError(f"bucket_seconds={self.bucket_seconds} must be > 0.")
        if self.autotune is not None:
            self.autotune = resolve_autotune(self.autotune)
        if self.link_aware is None:
            self.link_aware = not chosen and self.autotune is None


LINK_MIN_BUCKET_BYTES = 256 * 1024
"""Smallest bucket cap ``link_aware`` chooses: even at 20 Mbit/s a bucket of 256 KiB is ~0.1 s on
the wire, far above the ~0.5 ms a collective costs, and a model is not cut into hundreds."""


def link_paced_config(config: FusionConfig, process_set: ProcessSet,
                      device: torch.device) -> tuple[FusionConfig, LinkEstimate]:
    """Probe the link among ``process_set`` (a collective: every member calls it with the same
    config) and return ``config`` with its bucket caps lowered to about ``bucket_seconds`` on
    that link (at least :data:`LINK_MIN_BUCKET_BYTES`), ``link_aware`` and ``autotune`` off
    (the caps are final), with the measured link."""
    link = probe_link(process_set, device)
    cap = bucket_cap_bytes(link, config.bucket_seconds, LINK_MIN_BUCKET_BYTES,
                           config.fusion_threshold_bytes)
    first = min(config.first_bucket_bytes, cap)
    paced = FusionConfig(fusion_threshold_bytes=cap, first_bucket_bytes=first, autotune=None,
                         link_aware=False, bucket_seconds=config.bucket_seconds,
                         hierarchical=config.hierarchical)
    _log.info("link ~%.1f MB/s (allreduce latency %.2f ms): gradient buckets capped at %d KiB",
              link.bytes_per_s / 1e6, link.latency_s * 1e3, cap // 1024)
    return paced, link


class _Bucket:
    """One bucket of the layout; also what a hook sees of it (DDP's ``GradBucket`` methods, see
    :class:`~hvd_trainer.comm.reduce.bucket_hooks.GradBucket`)."""

    __slots__ = (
        "order", "last", "params", "names", "offsets", "flat", "views", "used", "used_flags", "ready",
        "work", "sig", "grad_numel", "pending", "fuse_scale", "adopted", "hook_buffer",
    )

    def __init__(self, order: int, names: list[str], params: list[torch.Tensor]) -> None:
        self.order = order  # launch position
        self.last = False  # set by the reducer once the layout is complete
        self.hook_buffer: torch.Tensor | None = None  # a user hook's set_buffer(), this launch
        self.names = names
        self.params = params
        numels = [p.numel() for p in params]
        self.offsets = [sum(numels[:i]) for i in range(len(numels))]
        self.grad_numel = sum(numels)
        # One trailing "used" flag per parameter travels in the same collective: after the sum
        # it is 0 exactly when no rank produced a gradient, and such a gradient is left None,
        # as in a single process (and as DDP does for globally unused parameters).
        self.flat = torch.zeros(
            self.grad_numel + len(params), dtype=params[0].dtype, device=params[0].device
        )
        self.views = [
            self.flat[o : o + n].view_as(p)
            for o, n, p in zip(self.offsets, numels, params, strict=True)
        ]
        self.used = self.flat[self.grad_numel :]
        self.used_flags = [1.0] * len(params)  # written into ``used`` once per launch
        self.ready = [False] * len(params)
        self.pending = len(params)  # hooks still to fire before the bucket can launch
        self.adopted = [False] * len(params)  # .grad is the (scaled) bucket view this step
        # Large tensors: copy and scale in one pass each (memory-bound); many small ones: one
        # multi-tensor copy, then one scale of the whole bucket (dispatch-bound).
        self.fuse_scale = self.grad_numel * self.flat.element_size() >= _FUSE_SCALE_BYTES * len(params)
        self.work: BucketWork | None = None
        self.sig: Signature | None = None

    @property
    def nbytes(self) -> int:
        """Gradient bytes in this bucket (the per-parameter used flags not counted)."""
        return self.grad_numel * self.flat.element_size()

    def seal(self) -> None:
        """Write the used flags into the buffer (at the launch, every view written)."""
        if all(self.used_flags):
            self.used.fill_(1)  # a device kernel: no host<->GPU copy, so no sync with backward
        else:  # rare (unused parameters): a small synchronous copy
            self.used.copy_(torch.tensor(self.used_flags, dtype=self.used.dtype))

    # -- DDP's GradBucket methods (what a user's communication hook calls) --------------------
    def index(self) -> int:
        """The bucket's launch position (0 = the first launched: the last layers')."""
        return self.order

    def is_last(self) -> bool:
        """Whether this is the last bucket launched in a step."""
        return self.last

    def buffer(self) -> torch.Tensor:
        """The flattened gradients (1-D, ``grad_numel`` elements; the used flags not included),
        or the tensor a hook set with :meth:`set_buffer` during this launch."""
        return self.flat[: self.grad_numel] if self.hook_buffer is None else self.hook_buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Make :meth:`buffer` (and :meth:`gradients`) return ``tensor`` for this launch (a
        wrapper's compressed copy, e.g. ``fp16_compress_wrapper``)."""
        self.hook_buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter views of :meth:`buffer`, shaped like the parameters."""
        if self.hook_buffer is None:
            return list(self.views)
        buf = self.hook_buffer
        return [buf[o : o + p.numel()].view(p.shape)
                for o, p in zip(self.offsets, self.params, strict=True)]

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in its order."""
        return list(self.params)


def _assign_buckets(
    named: Sequence[tuple[str, torch.Tensor]], config: FusionConfig
) -> list[list[int]]:
    """Indices into ``named`` per bucket, last parameter first, one (device, dtype) per bucket."""
    buckets: list[list[int]] = []
    open_bucket: dict[tuple[torch.device, torch.dtype], tuple[list[int], int]] = {}
    for idx in reversed(range(len(named))):
        p = named[idx][1]
        key = (p.device, p.dtype)
        nbytes = p.numel() * p.element_size()
        current = open_bucket.get(key)
        first = current is not None and current[0] is buckets[0]
        cap = config.first_bucket_bytes if first else config.fusion_threshold_bytes
        if current is not None and current[1] + nbytes <= cap:
            current[0].append(idx)
            open_bucket[key] = (current[0], current[1] + nbytes)
            continue
        new: list[int] = [idx]
        buckets.append(new)
        open_bucket[key] = (new, nbytes)
    return buckets


class GradientReducer:
    """Averages (or sums) the gradients of ``named_parameters`` across ranks while backward runs.

    Example:
        >>> reducer = GradientReducer(model.named_parameters(), world=hvd_trainer.comm.init())
        >>> loss.backward()
        >>> reducer.wait()          # every p.grad now holds the average over ranks
        >>> optimizer.step()

    Args:
        named_parameters: ``(name, parameter)`` pairs, the same names in the same order on every
            rank. Parameters with ``requires_grad=False`` at construction are skipped.
        world: the world to reduce over.
        config: bucket sizes.
        op: ``Average`` (default), ``Sum`` or ``Adasum`` (each parameter's gradient combined by
            its dot products, :func:`~hvd_trainer.comm.reduce.bucket_hooks.adasum_hook`; with
            ``compression`` none, fp16 or bf16).
        compression: wire format of floating gradients (``Compression.none/fp16/bf16``).
            ``fp16`` adds one blocking 4-byte allreduce per bucket (the global scale, see
            :mod:`hvd_trainer.comm.ops.compression`); ``bf16`` stays fully asynchronous.
            ``Compression.int8`` / ``Compression.powersgd(rank=r)``: lossy, with error feedback
            (:mod:`hvd_trainer.comm.reduce.compressed`); the per-parameter state is
            :meth:`compression_state_dict`.
        prescale_factor: multiply gradients by this before the sum (e.g. a gradient predivide).
        postscale_factor: multiply by this after the sum (on top of ``1/size`` for Average).
        process_set: reduce over these ranks only; on other ranks the reducer does nothing.
        hook: the algorithm, a hook ``(HookState, bucket) -> work``
            (:mod:`hvd_trainer.comm.reduce.bucket_hooks`); default: the one ``compression``
            needs (:func:`~hvd_trainer.comm.reduce.bucket_hooks.builtin_hook`).
        comm_hook: ``(state, hook)``: a DDP-style communication hook
            (``DistributedDataParallel.register_comm_hook``'s contract, e.g.
            ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook`` with its
            ``PowerSGDState``) called with ``state`` and each bucket instead of the built-in
            reduction; it averages, so ``op`` must be Average and ``compression`` none. A
            parameter unused on every rank then gets the hook's result (zeros for a linear
            reduction, as in Horovod) instead of ``None``, and :attr:`wire_bytes_sent` does not
            count what the hook sends.
        register_hooks: ``False``: register no autograd hook; the caller's own
            ``post_accumulate_grad`` hook calls :meth:`grad_ready` (one hook per parameter, e.g.
            an optimizer that also counts backward passes).

    Raises:
        ValueError: duplicate names or parameters, an op other than Average/Sum/Adasum, Adasum
            with an error-feedback compression, or ``comm_hook`` with ``op`` other than Average
            or a compression.
        CollectiveMismatchError: (first step) the bucket layout differs between ranks.
        CommValueError: (at :meth:`wait`) a ``comm_hook``'s future holds no tensor of the
            bucket's size.
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
        hook: BucketHook | None = None,
        comm_hook: tuple[Any, BucketHook] | None = None,
        register_hooks: bool = True,
    ) -> None:
        self.world = world
        self.config = config or FusionConfig()
        self.op = to_reduce_op(op)
        if self.op not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM):
            raise ValueError(f"gradient reduction supports Average, Sum or Adasum, got {self.op}.")
        self.compression = Compression.resolve(compression, error=CommTypeError, allow_error_feedback=True)
        if self.op is ReduceOp.ADASUM and self.compression.error_feedback:
            raise ValueError(f"op=Adasum with {self.compression!r}: Adasum has no error feedback. "
                             "HINT: use compression none, fp16 or bf16 with Adasum.")
        if comm_hook is not None:
            _check_comm_hook(comm_hook, self.op, self.compression)
        self._feedback = FeedbackState(self.compression.name) if self.compression.error_feedback else None
        self.prescale_factor = prescale_factor
        self.postscale_factor = postscale_factor
        self.active = process_set is None or process_set.included()
        self.process_set = resolve_set(process_set, world, "GradientReducer") if self.active else None
        set_size = process_set.size() if process_set is not None else world.size
        # Gradients are scaled while they are copied into the bucket (one pass): prescale and,
        # for Average, 1/N before the sum, which also keeps fp16 sums from overflowing. A
        # DDP-style hook gets the local gradients and averages them itself.
        averaged_here = self.op is ReduceOp.AVERAGE and comm_hook is None
        self._pre_factor = prescale_factor / (set_size if averaged_here else 1)
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        _check_unique(named)
        self.require_sync = True
        self._named = named
        self.link: LinkEstimate | None = None
        """The measured link when ``config.link_aware`` applied (several hosts), else None."""
        self.hierarchy: HostTopology | None = None
        """The host groups when buckets are reduced hierarchically, else None."""
        if self.active and named and world.cross_size > 1:
            self._fit_to_hosts(world, named[0][1].device)
        self._buckets: list[_Bucket] = []
        self._slot: dict[int, tuple[_Bucket, int]] = {}
        # A user hook is part of each bucket's signature: a hook on some ranks only, or another
        # hook on another rank, is a mismatch error on the first step, not a transport abort.
        self._hook_name = None if comm_hook is None else _hook_name(comm_hook[1])
        self._build(_assign_buckets(named, self.config))
        self._tuner, self._layouts = self._make_tuner(world)
        self._state: HookState | None = None if self.process_set is None else HookState(
            process_set=self.process_set, op=self.op, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, compression=self.compression,
            hierarchy=self.hierarchy, feedback=self._feedback)
        self._user_hook = comm_hook is not None
        if comm_hook is not None:
            self._hook, self._hook_state = user_hook(comm_hook[1]), (self._state, comm_hook[0])
        else:
            self._hook, self._hook_state = hook or builtin_hook(self.compression, self.op), self._state
        self._last_wait: float | None = None
        self._next_launch = 0
        self._saw_missing_grad = False
        self._end_queued = False  # the end-of-backward callback is queued for this backward
        self._handles = []
        if self.active and register_hooks:
            self._handles = [
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
                for b in self._buckets
                for p in b.params
            ]

    def _fit_to_hosts(self, world: World, device: torch.device) -> None:
        """Several hosts: choose flat or hierarchical buckets, then pace the caps to the link.
        Collective (every rank of the reducer reaches it with the same config)."""
        assert self.process_set is not None
        cfg = self.config
        if cfg.hierarchical or (cfg.hierarchical is None and cfg.link_aware):
            topo = build_topology(world, self.process_set)
            if topo is not None and cfg.hierarchical is None:
                flat_s, hier_s = time_paths(self.process_set, device, hierarchical_launch(topo))
                _log.info("hierarchical allreduce %.1f ms vs flat %.1f ms (256 KiB)",
                          hier_s * 1e3, flat_s * 1e3)
                topo = topo if hier_s < 0.95 * flat_s else None
            self.hierarchy = topo
        if cfg.link_aware:
            self._pace_buckets_to_link(device)

    def _pace_buckets_to_link(self, device: torch.device) -> None:
        """Probe the link (collective) and lower the bucket caps to ~``bucket_seconds`` on it."""
        assert self.process_set is not None
        self.config, self.link = link_paced_config(self.config, self.process_set, device)

    def _build(self, layout: list[list[int]]) -> None:
        """Make the buckets of ``layout`` (indices into the parameter list); current gradients
        are copied into the new buffers and ``.grad`` re-pointed at them."""
        named = self._named
        self._buckets, self._slot = [], {}
        for indices in layout:
            bucket = self._new_bucket(
                len(self._buckets), [named[i][0] for i in indices], [named[i][1] for i in indices]
            )
            self._buckets.append(bucket)
            for pos, p in enumerate(bucket.params):
                self._slot[id(p)] = (bucket, pos)
                if p.grad is not None:
                    with torch.no_grad():  # a gradient from create_graph=True requires grad
                        bucket.views[pos].copy_(p.grad)
                    p.grad = bucket.views[pos]
        for bucket in self._buckets:
            bucket.sig = self._bucket_signature(bucket)
        if self._buckets:
            self._buckets[-1].last = True

    def _new_bucket(self, index: int, names: list[str], params: list[torch.Tensor]) -> _Bucket:
        """One bucket of the layout (a subclass may lay its buffer out differently)."""
        return _Bucket(index, names, params)

    def _make_tuner(self, world: World) -> tuple[Autotuner | None, dict[Candidate, list[list[int]]]]:
        tune = self.config.autotune
        if tune is None or not self.active or not self._named:
            return None, {}
        layouts: dict[Candidate, list[list[int]]] = {}
        seen: set[tuple[tuple[int, ...], ...]] = set()
        configured = (self.config.fusion_threshold_bytes, self.config.first_bucket_bytes)
        for threshold, first in candidate_thresholds(configured):
            cfg = FusionConfig(fusion_threshold_bytes=threshold, first_bucket_bytes=first, autotune=None)
            layout = _assign_buckets(self._named, cfg)
            key = tuple(tuple(b) for b in layout)
            if key not in seen:
                seen.add(key)
                layouts[Candidate(threshold, first, len(layout))] = layout
        return Autotuner(list(layouts), tune, rank=world.rank), layouts

    @property
    def autotuner(self) -> Autotuner | None:
        """The layout search (``None`` without autotune); ``autotuner.done`` once it has chosen."""
        return self._tuner

    def _autotune_step(self) -> None:
        """Time the step that just ended; at a sample's end agree across ranks and re-bucket."""
        tuner = self._tuner
        assert tuner is not None and self.process_set is not None
        now = time.perf_counter()
        last, self._last_wait = self._last_wait, now
        if last is None or not tuner.record(now - last):
            return
        agreed = torch.tensor([tuner.local_sample()], dtype=torch.float64)
        start_allreduce(agreed, op=ReduceOp.MAX, pset=self.process_set, name="autotune.step_seconds",
                        kind="autotune").finish()
        before = tuner.candidates[tuner.current]
        nxt = tuner.advance(float(agreed.item()))
        if nxt is not None and nxt != before:
            self._build(self._layouts[nxt])
        self._last_wait = time.perf_counter()  # re-bucketing is not part of the next step

    def _bucket_signature(self, bucket: _Bucket) -> Signature:
        layout = [f"{n}:{list(p.shape)}" for n, p in zip(bucket.names, bucket.params, strict=True)]
        extra = (("bucket", f"{bucket.order + 1} of {len(self._buckets)}"), ("parameters", layout))
        if self._hook_name is not None:
            extra += (("comm_hook", self._hook_name),)
        return signature(
            "bucket", f"gradients[{bucket.names[0]}..{bucket.names[-1]}]", bucket.flat, self.op,
            self.prescale_factor, self.postscale_factor, self.compression, extra,
        )

    # -- properties -------------------------------------------------------------------------
    @property
    def bucket_sizes_bytes(self) -> list[int]:
        """Size of each bucket in bytes, in launch order."""
        return [b.nbytes for b in self._buckets]

    @property
    def bucket_names(self) -> list[list[str]]:
        """Parameter names in each bucket, in launch order."""
        return [list(b.names) for b in self._buckets]

    @property
    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The ``(name, parameter)`` pairs reduced, in registration order."""
        return list(self._named)

    def grad_ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient of this backward pass is accumulated (with
        ``register_hooks=False``, the caller's hook calls this; otherwise the reducer's own hook
        does). A no-op on ranks outside the process set.

        Raises:
            RuntimeError: the gradient was produced twice before :meth:`wait`.
        """
        if self.active:
            self._on_grad_ready(param)

    @property
    def pending(self) -> bool:
        """True between the first gradient of a synchronised backward and :meth:`wait`."""
        return self._next_launch > 0 or any(any(b.ready) for b in self._buckets)

    # -- hooks ------------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        # Runs once per parameter per backward, so it stays lean: a bucket of large tensors
        # copies each gradient in at once (one pass each, nothing held); a bucket of small ones
        # copies them all in one dispatch when its last gradient is ready. At the end of backward
        # the ready gradients of incomplete buckets are copied in too (see _after_backward).
        if not self.require_sync:
            return
        bucket, pos = self._slot[id(param)]
        ready = bucket.ready
        if ready[pos] or bucket.work is not None:
            raise RuntimeError(
                f"gradient of {bucket.names[pos]!r} was produced twice before the reducer's "
                "wait(). HINT: call backward once per step, or wrap extra backward passes in "
                "no_sync() (gradient accumulation)."
            )
        ready[pos] = True
        bucket.pending -= 1
        if bucket.fuse_scale:
            self._adopt(bucket, (pos,))
        elif not bucket.pending:
            self._adopt(bucket, range(len(bucket.params)))
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        if not bucket.pending and bucket.order == self._next_launch:
            self._launch_ready()

    def _after_backward(self) -> None:
        """End of a backward pass: copy in the gradients that are ready in buckets that cannot
        launch yet (a parameter unused on this rank), so that after ``backward()`` every produced
        ``.grad`` is its bucket view (reduced in place by :meth:`wait`, as in Horovod) and no
        autograd-owned gradient is held until then."""
        self._end_queued = False
        for bucket in self._buckets[self._next_launch :]:
            if bucket.pending:
                self._adopt(bucket, [i for i, r in enumerate(bucket.ready) if r])

    def _adopt(self, bucket: _Bucket, positions: Iterable[int]) -> None:
        """Make ``param.grad`` the bucket view, multiplied by the pre-sum factor, at ``positions``
        not adopted yet this step.

        A new tensor from autograd (``.grad`` was ``None`` before backward) is copied in; a
        gradient already in its view (accumulated in place) is scaled there; a missing one becomes
        zeros (and its "used" flag 0). Large tensors: ``torch.mul(g, f, out=view)``, copy and scale
        in one pass; small ones: one ``torch._foreach_copy_`` and one ``torch._foreach_mul_`` for
        all of ``positions``.
        """
        factor = self._pre_factor
        fuse = bucket.fuse_scale
        copy_views: list[torch.Tensor] = []
        copy_grads: list[torch.Tensor] = []
        scale_views: list[torch.Tensor] = []
        with torch.no_grad():
            for pos in positions:
                if bucket.adopted[pos]:
                    continue
                bucket.adopted[pos] = True
                param, view = bucket.params[pos], bucket.views[pos]
                grad = param.grad
                bucket.used_flags[pos] = 0.0 if grad is None else 1.0
                if grad is None:
                    self._saw_missing_grad = True
                    view.zero_()
                    if param.requires_grad:  # frozen on this step (e.g. toggle_optimizer): keep None
                        param.grad = view
                    continue
                if grad.is_sparse:  # e.g. Embedding(sparse=True): reduced densely, in the bucket
                    grad = grad.to_dense()
                elif grad.data_ptr() == view.data_ptr():
                    scale_views.append(view)
                    continue
                if fuse:
                    torch.mul(grad.view_as(view), factor, out=view)
                else:
                    copy_views.append(view)
                    copy_grads.append(grad)
                param.grad = view
            if copy_views:
                torch._foreach_copy_(copy_views, copy_grads)
            if factor != 1.0 and (copy_views or scale_views):
                torch._foreach_mul_(copy_views + scale_views, factor)

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.pending:
                return
            self._adopt(bucket, range(len(bucket.params)))
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        """Seal the complete bucket and hand it to the hook (the one seam of every algorithm)."""
        bucket.seal()
        bucket.work = self._hook(self._hook_state, bucket)
        self._next_launch += 1

    # -- public API -------------------------------------------------------------------------
    @property
    def wire_bytes_sent(self) -> int:
        """Bytes this rank has put on the wire for gradient buckets so far: the transport's
        payload counted as a ring collective sends it (allreduce ``2 (N-1)/N`` of the wire
        payload, allgather ``N-1`` times it; ZeRO-2's reduce-scatter: the segments sent to the other
        ranks, see :attr:`hvd_trainer.comm.zero.collectives.ScatterWork.wire_bytes`); headers and
        the cross-rank checks not included."""
        fb = 0 if self._feedback is None else self._feedback.bytes_sent
        return (0 if self._state is None else self._state.bytes_sent) + fb

    @property
    def feedback_state(self) -> FeedbackState | None:
        """The error-feedback state (``int8``/``powersgd``), else ``None``."""
        return self._feedback

    def compression_state_dict(self) -> dict | None:
        """Copies of the error-feedback state (residuals, PowerSGD's Q) by parameter name, or
        ``None`` for stateless compression. Training state: save it with the optimizer."""
        return None if self._feedback is None else self._feedback.state_dict()

    def load_compression_state_dict(self, state: dict) -> None:
        """Restore :meth:`compression_state_dict`'s output (entries of parameters this reducer
        does not hold are dropped).

        Raises:
            ValueError: the state was saved with another compression (or none is in use).
        """
        if self._feedback is None:
            raise ValueError(f"this reducer uses {self.compression!r}, which has no state to load.")
        mine = {n for n, _ in self._named}
        self._feedback.load_state_dict(rename_feedback(state, lambda k: k if k in mine else None))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally and send nothing."""
        previous = self.require_sync
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = previous

    def wait(self) -> None:
        """Finish the reduction of this step. On return every ``p.grad`` is reduced.

        A parameter whose hook did not fire on this rank (unused in this forward) contributes
        its current ``.grad`` or zeros, so every rank issues the same collectives. A parameter
        with ``requires_grad=False`` and no gradient keeps ``.grad=None``. No-op on ranks
        outside the reducer's process set.
        """
        if not self.active:
            return
        for bucket in self._buckets[self._next_launch :]:
            bucket.ready = [True] * len(bucket.params)
            bucket.pending = 0
        try:
            self._launch_ready()  # a launch that raises (a mismatch, a hook) ends the step too
            for bucket in self._buckets:
                assert bucket.work is not None
                bucket.work.finish()
            # common path (every gradient present): no host sync; a user hook reduces no flags
            if self._saw_missing_grad and not self._user_hook:
                self._drop_globally_unused()
        finally:
            self._saw_missing_grad = False
            self._end_queued = False  # a backward that raised never ran its callback
            for bucket in self._buckets:
                bucket.work = None
                bucket.hook_buffer = None
                bucket.ready = [False] * len(bucket.params)
                bucket.adopted = [False] * len(bucket.params)
                bucket.pending = len(bucket.params)
            self._next_launch = 0
            if self._state is not None:
                self._state.in_flight = None
        if self._tuner is not None and not self._tuner.done:
            self._autotune_step()

    def _drop_globally_unused(self) -> None:
        """Reset ``.grad`` to None where no rank produced a gradient this step."""
        for bucket in self._buckets:
            unused = (bucket.used == 0).nonzero().flatten().tolist()
            for pos in unused:
                param = bucket.params[pos]
                if param.grad is not None and param.grad.data_ptr() == bucket.views[pos].data_ptr():
                    param.grad = None

    def remove(self) -> None:
        """Unregister the hooks; gradients stay where they are."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _hook_name(hook: Any, depth: int = 0) -> str:
    """A hook's name as every rank spells it (a wrapper's inner function: ``wrapper(hook)``)."""
    name = f"{getattr(hook, '__module__', '')}.{getattr(hook, '__qualname__', type(hook).__name__)}"
    if depth >= 2:
        return name
    inner = [c.cell_contents for c in (getattr(hook, "__closure__", None) or ())
             if callable(c.cell_contents) and c.cell_contents is not hook]
    return name + "".join(f"({_hook_name(f, depth + 1)})" for f in inner)


def _check_comm_hook(comm_hook: Any, op: ReduceOp, compression: Compressor) -> None:
    """Refuse a DDP-style ``(state, hook)`` that cannot run with ``op`` and ``compression``."""
    if not (isinstance(comm_hook, tuple) and len(comm_hook) == 2 and callable(comm_hook[1])):
        raise ValueError(f"comm_hook={comm_hook!r:.80} must be a pair (state, hook) with hook(state, "
                         "bucket) -> torch.futures.Future. HINT: comm_hook=(None, allreduce_hook).")
    refuse_with_hook(op, compression, spelled="comm_hook", error=ValueError)


def _check_unique(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    seen_names: set[str] = set()
    seen_params: set[int] = set()
    for name, p in named:
        if name in seen_names:
            raise ValueError(f"parameter name {name!r} appears twice; names must be unique.")
        if id(p) in seen_params:
            raise ValueError(f"parameter {name!r} is listed twice under different names.")
        seen_names.add(name)
        seen_params.add(id(p))

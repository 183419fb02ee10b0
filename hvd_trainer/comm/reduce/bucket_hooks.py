"""The one seam every bucket algorithm runs through: a hook ``(state, bucket) -> future``.

The gradient reducer (:mod:`hvd_trainer.comm.reduce.fusion`) calls one hook per complete bucket,
in bucket order, while backward runs, in the shape of DDP's communication hooks
(``DistributedDataParallel.register_comm_hook``); it waits on what the hook returned at the end
of the step. The reducer's own algorithms are hooks here, chosen once by :func:`builtin_hook`:

* :func:`allreduce_hook`: the plain allreduce, the ``fp16``/``bf16`` wire casts, and the
  hierarchical allreduce (inside each host, then across hosts) when the state holds a topology;
* :func:`feedback_hook`: ``int8`` and PowerSGD with error feedback
  (:mod:`hvd_trainer.comm.reduce.compressed`);
* :func:`adasum_hook`: ``op=Adasum``, each parameter's gradient combined with its own dot products
  (:mod:`hvd_trainer.comm.ops.adasum`);
* ZeRO stage 2's reduce-scatter to the owners is ``hvd_trainer.comm.zero.reducer``'s hook.

A built-in hook returns the comm layer's work (an object with ``finish()``); the bucket it gets
holds the gradients already multiplied by the pre-sum factor (``1/N`` for Average) followed by one
"used" flag per parameter, all in ``bucket.flat``.

A user's hook (DDP's contract, so ``torch.distributed.algorithms.ddp_comm_hooks``' hooks run
unchanged: ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook``,
the ``*_compress_wrapper``\\s) gets the bucket through :class:`GradBucket`'s methods:
``buffer()`` is the flattened local gradients (multiplied by ``prescale_factor`` only, not
divided by N: the hook averages), ``gradients()`` their per-parameter views, ``parameters()``,
``index()``, ``is_last()``, ``set_buffer()``. It returns a ``torch.futures.Future`` whose value
is the reduced buffer (a tensor, or a one-element list of it), which :class:`HookWork` copies
into the bucket. :func:`user_hook` wraps such a hook: every rank's bucket layout is still checked
across ranks before the hook runs (a mismatch is an error on the first step, not a hang).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hvd_trainer.comm.base.errors import CommValueError
from hvd_trainer.comm.ops.adasum import start_adasum
from hvd_trainer.comm.ops.checks import Op, Signature
from hvd_trainer.comm.ops.compression import Compression, Compressor
from hvd_trainer.comm.ops.ops import ReduceOp
from hvd_trainer.comm.ops.process_set import ProcessSet
from hvd_trainer.comm.ops.reduce import start_allreduce
from hvd_trainer.comm.reduce.compressed.reductions import BucketView, FeedbackState, start_bucket_reduction
from hvd_trainer.comm.reduce.hierarchical import HierarchicalWork, HostTopology

__all__ = ["BucketHook", "BucketWork", "GradBucket", "HookState", "HookWork", "adasum_hook", "allreduce_hook",
           "builtin_hook", "feedback_hook", "hierarchical_launch", "refuse_with_hook", "user_hook"]


class BucketWork(Protocol):
    """A bucket's reduction in flight: ``finish()`` waits and leaves the result in the bucket."""

    def finish(self) -> Any: ...


class GradBucket(Protocol):
    """What a hook sees of a bucket (the reducer's bucket implements it).

    DDP's ``GradBucket`` methods, plus the reducer's own fields the built-in hooks use."""

    flat: torch.Tensor
    """The bucket's buffer: ``grad_numel`` gradient values, then one "used" flag per parameter
    (ZeRO stage 2: laid out by owner)."""
    grad_numel: int
    names: list[str]
    views: list[torch.Tensor]
    sig: Signature | None

    def index(self) -> int: ...

    def buffer(self) -> torch.Tensor: ...

    def gradients(self) -> list[torch.Tensor]: ...

    def parameters(self) -> list[torch.Tensor]: ...

    def is_last(self) -> bool: ...

    def set_buffer(self, tensor: torch.Tensor) -> None: ...


BucketHook = Callable[[Any, GradBucket], Any]
"""``hook(state, bucket)``: launch the reduction of ``bucket``; returns a :class:`BucketWork` (a
built-in hook) or a ``torch.futures.Future`` of the reduced buffer (a DDP-style hook)."""


@dataclass(kw_only=True, slots=True)
class HookState:
    """The built-in hooks' state: where and how a bucket is reduced, and what was sent."""

    process_set: ProcessSet
    """The ranks the bucket is reduced over."""
    op: ReduceOp
    """``AVERAGE``, ``SUM`` or ``ADASUM`` (the ``1/N`` of Average is already in the bucket)."""
    prescale_factor: float = 1.0
    """Already applied to the bucket; part of the collective's signature."""
    postscale_factor: float = 1.0
    """Applied after the sum."""
    compression: Compressor
    """The wire format (:class:`~hvd_trainer.comm.ops.compression.Compression`)."""
    hierarchy: HostTopology | None = None
    """Reduce inside each host, then across hosts (:func:`allreduce_hook`)."""
    feedback: FeedbackState | None = None
    """The error-feedback state (:func:`feedback_hook`)."""
    bytes_sent: int = 0
    """Bytes this rank put on the wire for buckets so far, as a ring collective sends them (the
    error-feedback reductions count theirs in :attr:`feedback`)."""
    in_flight: Any = None
    """The last future a user's hook returned (:func:`user_hook`)."""


def hierarchical_launch(topo: HostTopology) -> Callable[[torch.Tensor, Any], HierarchicalWork]:
    """The transport of a hierarchical allreduce over ``topo`` (``start_allreduce``'s ``launch``)."""
    return lambda wire, torch_op: HierarchicalWork(wire, torch_op, topo)


def allreduce_hook(state: HookState, bucket: GradBucket) -> BucketWork:
    """Allreduce the whole bucket buffer (gradients and used flags) in place, in the state's wire
    format, hierarchically when the state holds a topology; the result is multiplied by
    ``postscale_factor``."""
    pset = state.process_set
    state.bytes_sent += state.compression.allreduce_wire_bytes([bucket.flat], pset.size())
    return start_allreduce(
        bucket.flat, op=state.op, pset=pset, name=bucket.sig.name if bucket.sig else None,
        prescale_factor=state.prescale_factor, postscale_factor=state.postscale_factor,
        compression=state.compression, kind="bucket", sig=bucket.sig,
        prescaled_post_factor=state.postscale_factor,
        launch=None if state.hierarchy is None else hierarchical_launch(state.hierarchy),
    )


def feedback_hook(state: HookState, bucket: GradBucket) -> BucketWork:
    """Reduce the bucket with the state's error-feedback compressor (``int8``, PowerSGD; see
    :func:`~hvd_trainer.comm.reduce.compressed.reductions.start_bucket_reduction`)."""
    assert state.feedback is not None and bucket.sig is not None
    view = BucketView(bucket.flat, bucket.grad_numel, bucket.names, bucket.views)
    return start_bucket_reduction(view, state.compression, state.feedback, pset=state.process_set,
                                  sig=bucket.sig, post_factor=state.postscale_factor)


def adasum_hook(state: HookState, bucket: GradBucket) -> BucketWork:
    """Adasum of the bucket (Maleki et al. 2021, arXiv:2006.02924) over the state's ranks, in
    place: each parameter's gradient with its own dot products and norms, as Horovod combines
    each tensor; each "used" flag is its own one-element segment (Adasum of 1s and 0s is 1 when
    any rank used the parameter). The result is multiplied by ``postscale_factor``."""
    assert bucket.sig is not None
    pset = state.process_set
    numels = [v.numel() for v in bucket.views]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    segments = [*zip(offsets, numels, strict=True),
                *((bucket.grad_numel + i, 1) for i in range(len(numels)))]
    compression = state.compression
    state.bytes_sent += compression.allreduce_wire_bytes([bucket.flat], pset.size(), adasum=True)
    return start_adasum(bucket.flat, pset=pset, sig=bucket.sig, name=bucket.sig.name, segments=segments,
                        postscale_factor=state.postscale_factor, compression=compression, kind="bucket")


def refuse_with_hook(op: ReduceOp, compression: Compressor, *, spelled: str,
                     error: type[Exception]) -> None:
    """Refuse the ``op`` and ``compression`` a DDP-style hook would override (it averages the
    bucket and decides its wire format itself); ``spelled``: the hook's argument as the caller
    names it, for the message.

    Raises:
        error: ``compression`` other than none, or ``op`` other than Average, with a HINT.
    """
    if compression is not Compression.none:
        raise error(f"{spelled} with compression={compression.name!r}: the hook decides the wire "
                    "format. HINT: drop compression=, or use a compressing hook (bf16_compress_hook, "
                    "powerSGD_hook).")
    if op is not ReduceOp.AVERAGE:
        raise error(f"{spelled} with op={op.name.title()}: a communication hook averages the bucket "
                    "itself (DDP's contract). HINT: use op=Average with a hook.")


def builtin_hook(compression: Compressor, op: ReduceOp = ReduceOp.AVERAGE) -> BucketHook:
    """The reducer's hook for ``compression`` and ``op`` (the one place an algorithm is chosen)."""
    if op is ReduceOp.ADASUM:
        return adasum_hook
    return feedback_hook if compression.error_feedback else allreduce_hook


class HookWork:
    """A user hook's future: :meth:`finish` waits, copies the value into the bucket's
    gradients (when it is another tensor) and applies ``postscale_factor``; the cross-rank check
    ``op`` taken before the hook ran is then settled."""

    __slots__ = ("future", "bucket", "op", "process_set", "postscale_factor", "finished")

    def __init__(self, future: Any, bucket: GradBucket, op: Op, process_set: ProcessSet,
                 postscale_factor: float) -> None:
        self.future, self.bucket, self.op = future, bucket, op
        self.process_set, self.postscale_factor = process_set, postscale_factor
        self.finished = False

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        """Wait for the hook's future and write its value into the bucket's gradients.

        Raises:
            CommValueError: the hook returned no future, or its value is not one tensor of the
                bucket's size.
        """
        grads = self.bucket.flat[: self.bucket.grad_numel]
        if self.finished:
            return grads
        try:
            value = self.future.wait()
            if isinstance(value, list | tuple) and len(value) == 1:
                value = value[0]
            if not isinstance(value, torch.Tensor) or value.numel() != grads.numel():
                got = (f"a tensor of {value.numel()} elements" if isinstance(value, torch.Tensor)
                       else type(value).__name__)
                raise CommValueError(
                    f"the communication hook's future for bucket {self.bucket.index()} holds {got}; "
                    f"the bucket has {grads.numel()} gradient elements. HINT: return a "
                    "torch.futures.Future whose value is the reduced bucket.buffer(), as DDP's hooks "
                    "do (e.g. dist.all_reduce(buf, async_op=True).get_future().then(lambda f: "
                    "f.value()[0]))."
                )
            if value.data_ptr() != grads.data_ptr() or value.dtype != grads.dtype:
                grads.copy_(value.reshape(-1))
            if self.postscale_factor != 1.0:
                grads.mul_(self.postscale_factor)
        finally:
            self.process_set.coordinator.settle(self.op)
        self.finished = True
        return grads


def user_hook(hook: BucketHook) -> BucketHook:
    """Run a DDP-style ``hook(state, bucket) -> torch.futures.Future`` as a reducer hook: the
    bucket's signature is checked across ranks first, then the hook launches its own collectives.

    On CPU (gloo) the previous bucket's future is waited for before the next hook runs: a hook
    whose future callbacks block on another collective (torch's ``powerSGD_hook`` does) holds one
    of gloo's few worker threads each, and with more buckets in flight than threads every rank
    hangs (DDP's own reducer does). Backward still overlaps the bucket in flight.

    The returned hook's state is a pair ``(HookState, the user's state)``."""

    def run(state: tuple[HookState, Any], bucket: GradBucket) -> HookWork:
        ours, theirs = state
        pset = ours.process_set
        assert bucket.sig is not None
        if ours.in_flight is not None and bucket.flat.device.type == "cpu":
            ours.in_flight.wait()  # a hook's failure raises here, during backward
        op = pset.coordinator.begin(bucket.sig, bucket.grad_numel * bucket.flat.element_size())
        try:
            future = hook(theirs, bucket)
        except BaseException:
            pset.coordinator.settle(op)
            raise
        if not hasattr(future, "wait"):
            pset.coordinator.settle(op)
            raise CommValueError(
                f"the communication hook {getattr(hook, '__qualname__', hook)!r} returned "
                f"{type(future).__name__}, not a future. HINT: return a torch.futures.Future of "
                "the reduced bucket.buffer(), as DDP's hooks do."
            )
        ours.in_flight = future
        return HookWork(future, bucket, op, pset, ours.postscale_factor)

    run.__qualname__ = getattr(hook, "__qualname__", "user_hook")
    return run

"""Error-feedback reductions of one gradient bucket: ``int8`` and ``powersgd``.

The gradient reducer (:mod:`hvd_trainer.comm.reduce.fusion`) calls :func:`start_bucket_reduction`
instead of the plain allreduce when its compressor has ``error_feedback``; the returned object's
``finish()`` writes the reduced gradients into the bucket, like
:class:`~hvd_trainer.comm.ops.reduce.Reduction`. The bucket holds ``grad_numel`` gradient values
(already multiplied by the pre-sum factor, ``1/N`` for Average) followed by one "used" flag
per parameter; the flags always travel exactly (fp32 sum).

A step whose gradients are not finite (AMP's ``GradScaler`` found an overflow; every rank then
gets a non-finite result and skips the step) leaves the state as it was. The residual is in the
units of the gradient it was computed from, so with AMP it follows the loss scale (a scale change
rescales the next step's correction by that factor, a small transient bias).

State (:class:`FeedbackState`) is kept per parameter *name*, so it survives re-bucketing
(autotune) and is saved with the optimizer: the residual ``e`` (fp32, this rank's own) and, for
PowerSGD, the warm-start ``Q`` (the same on every rank).

Each reduction is one checked collective (kind ``"bucket"``, the compressor's name in its
signature); ``join`` is not supported while one is in flight.

Front ends whose gradients do not pass through the hook-driven buckets (Keras on TensorFlow,
where they leave the graph as numpy arrays; accumulated gradients reduced once per window) call
:func:`reduce_with_feedback` on a list of named tensors: the same reductions and the same
:class:`FeedbackState`, on one bucket per (device, dtype) built from the tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hvd_trainer.comm.base.errors import CommTypeError
from hvd_trainer.comm.ops.checks import Op, Signature
from hvd_trainer.comm.ops.compression import Compression, Compressor, Int8Compressor, PowerSGDCompressor
from hvd_trainer.comm.ops.ops import ReduceOp, to_reduce_op
from hvd_trainer.comm.ops.process_set import ProcessSet, resolve_set
from hvd_trainer.comm.ops.reduce import signature
from hvd_trainer.comm.reduce.compressed import int8 as q8
from hvd_trainer.comm.reduce.compressed.powersgd import initial_q, matrix_shape, orthogonalize_
from hvd_trainer.comm.world.world import World

__all__ = ["FeedbackState", "BucketView", "start_bucket_reduction", "reduce_with_feedback",
           "rename_feedback", "merge_feedback"]

PER_PARAMETER_KEYS = ("residuals", "q", "reductions")
"""The entries of :meth:`FeedbackState.state_dict` keyed by parameter name."""

_PAST_ANY_WARMUP = 2**62
"""The reduction count of a parameter in a state saved before counts were kept."""


@dataclass(slots=True)
class FeedbackState:
    """Per-parameter error-feedback state of one reducer, keyed by parameter name."""

    compressor: str
    residuals: dict[str, torch.Tensor] = field(default_factory=dict)
    """This rank's residual per parameter, fp32, the parameter's shape."""
    q: dict[str, torch.Tensor] = field(default_factory=dict)
    """PowerSGD's warm-start ``Q`` per compressed parameter (``m x r``, fp32; rank-independent)."""
    bytes_sent: int = 0
    """Bytes this rank put on the wire for these reductions (ring collectives)."""
    reductions: dict[str, int] = field(default_factory=dict)
    """How many times each parameter's gradient was reduced (PowerSGD's synchronous warm-up)."""
    unseen_reductions: int = 0
    """The count of a parameter missing from ``reductions`` (after loading a state saved before
    the count was kept: past any warm-up)."""

    def reduced(self, name: str) -> int:
        """How many times ``name``'s gradient was reduced so far."""
        return self.reductions.get(name, self.unseen_reductions)

    @property
    def empty(self) -> bool:
        """Nothing to carry: no residual, no ``Q`` and no reduction counted yet."""
        return not (self.residuals or self.q or self.reductions)

    def residual(self, name: str, like: torch.Tensor) -> torch.Tensor:
        r = self.residuals.get(name)
        if r is None or r.shape != like.shape or r.device != like.device:
            r = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
            self.residuals[name] = r
        return r

    def state_dict(self) -> dict[str, Any]:
        return {"compressor": self.compressor,
                "residuals": {k: v.clone() for k, v in self.residuals.items()},
                "q": {k: v.clone() for k, v in self.q.items()},
                "reductions": dict(self.reductions), "unseen_reductions": self.unseen_reductions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("compressor") != self.compressor:
            raise ValueError(
                f"the error-feedback state was saved with compression {state.get('compressor')!r}, "
                f"this reducer uses {self.compressor!r}. HINT: resume with the same compression."
            )
        self.residuals = {k: v.detach().clone().float() for k, v in state["residuals"].items()}
        self.q = {k: v.detach().clone().float() for k, v in state["q"].items()}
        self.reductions = {k: int(v) for k, v in state.get("reductions", {}).items()}
        self.unseen_reductions = int(state.get("unseen_reductions", 0)) if "reductions" in state \
            else _PAST_ANY_WARMUP


@dataclass(slots=True)
class BucketView:
    """What a reduction needs of a bucket."""

    flat: torch.Tensor
    grad_numel: int
    names: list[str]
    views: list[torch.Tensor]


def rename_feedback(state: dict[str, Any], rename: Callable[[str], str | None]) -> dict[str, Any]:
    """``state`` (a :meth:`FeedbackState.state_dict`) with every per-parameter entry's name
    replaced by ``rename(name)``, or dropped where it returns ``None``; an entry absent from
    ``state`` (a state saved before it existed) stays absent."""
    out = dict(state)
    for key in PER_PARAMETER_KEYS:
        if key in state:
            out[key] = {new: v for k, v in state[key].items() if (new := rename(k)) is not None}
    return out


def merge_feedback(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One state holding the per-parameter entries of ``states`` (disjoint parameter names;
    the first state's compressor)."""
    out: dict[str, Any] = {"compressor": states[0]["compressor"]}
    if "unseen_reductions" in states[0]:
        out["unseen_reductions"] = states[0]["unseen_reductions"]
    for key in PER_PARAMETER_KEYS:
        if any(key in s for s in states):
            out[key] = {k: v for s in states for k, v in s.get(key, {}).items()}
    return out


def start_bucket_reduction(
    bucket: BucketView, compressor: Compressor, state: FeedbackState, *, pset: ProcessSet,
    sig: Signature, post_factor: float,
) -> Any:
    """Launch the reduction of ``bucket`` (asynchronous where the algorithm allows).

    Returns:
        An object whose ``finish()`` waits and writes the reduced values into ``bucket.flat``.
    """
    if isinstance(compressor, Int8Compressor):
        return _Int8Reduction(bucket, compressor, state, pset, sig, post_factor)
    assert isinstance(compressor, PowerSGDCompressor)
    return _PowerSGDReduction(bucket, compressor, state, pset, sig, post_factor)


@torch.no_grad()
def reduce_with_feedback(
    named: Sequence[tuple[str, torch.Tensor]], *, compressor: Compressor, state: FeedbackState,
    world: World | None = None, op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, process_set: ProcessSet | None = None, name: str = "gradients",
    used: Sequence[float] | None = None,
) -> tuple[list[torch.Tensor], list[float]]:
    """Reduce ``named`` tensors over ranks with ``compressor``'s error feedback (blocking).

    The tensors are copied, multiplied by the pre-sum factor (``prescale_factor``, and ``1/N``
    for Average, as the gradient reducer does), into one bucket per (device, dtype) in the order
    given; each bucket is one :func:`start_bucket_reduction`, so the result, the residuals and
    PowerSGD's ``Q`` in ``state`` (keyed by the names) are those the hook-driven reducer would
    produce for the same gradients in one bucket. The buckets are launched before any is
    waited on. The inputs are not modified.

    Args:
        named: ``(name, tensor)`` pairs, floating tensors; the same names, shapes and dtypes in
            the same order on every rank (checked once, like a gradient bucket).
        compressor: ``Compression.int8`` or a ``Compression.powersgd(rank=r)``.
        state: the residuals (and ``Q``) carried between calls; updated in place.
        world: the world (``None``: the process set's); ``process_set``: reduce over it only
            (this rank must be a member).
        op: ``Average`` (default) or ``Sum``.
        prescale_factor / postscale_factor: multiply before the sum / after it.
        name: label of the collectives (in mismatch errors and the timeline).
        used: one flag per tensor (1.0: this rank produced it; default all 1.0), summed exactly.

    Returns:
        ``(reduced, used_sums)``: new tensors of the inputs' shapes and dtypes, and the flags
        summed over ranks (0 where no rank produced that tensor).

    Raises:
        CommTypeError: a compressor without error feedback, a non-floating tensor, or an op
            other than Average/Sum.
    """
    compressor = Compression.resolve(compressor, error=CommTypeError, allow_error_feedback=True)
    rop = to_reduce_op(op)
    if not compressor.error_feedback or rop not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise CommTypeError(
            f"reduce_with_feedback needs an error-feedback compressor (int8, powersgd) and op "
            f"Average or Sum, got compressor={compressor!r}, op={rop.name}. HINT: use allreduce_ "
            "for stateless compression."
        )
    flags = [1.0] * len(named) if used is None else [float(u) for u in used]
    if len(flags) != len(named):
        raise CommTypeError(f"reduce_with_feedback: {len(flags)} used flags for {len(named)} tensors.")
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (tname, t) in enumerate(named):
        if not t.is_floating_point():
            raise CommTypeError(f"reduce_with_feedback: {tname!r} has dtype {t.dtype}; gradients "
                                "must be floating. HINT: reduce integer tensors with allreduce_.")
        groups.setdefault((t.device, t.dtype), []).append(i)
    pset = resolve_set(process_set, world, "reduce_with_feedback")
    pre = prescale_factor / (pset.size() if rop is ReduceOp.AVERAGE else 1)
    works, buckets = [], []
    for indices in groups.values():
        bucket = _named_bucket([named[i] for i in indices], [flags[i] for i in indices], pre)
        layout = [f"{n}:{list(v.shape)}" for n, v in zip(bucket.names, bucket.views, strict=True)]
        sig = signature("bucket", f"{name}[{bucket.names[0]}..{bucket.names[-1]}]", bucket.flat, rop,
                        prescale_factor, postscale_factor, compressor, (("parameters", layout),))
        works.append(start_bucket_reduction(bucket, compressor, state, pset=pset, sig=sig,
                                            post_factor=postscale_factor))
        buckets.append((indices, bucket))
    out: list[Any] = [None] * len(named)
    sums = [0.0] * len(named)
    for work, (indices, bucket) in zip(works, buckets, strict=True):
        work.finish()
        summed = bucket.flat[bucket.grad_numel :].tolist()
        for k, (i, view) in enumerate(zip(indices, bucket.views, strict=True)):
            out[i], sums[i] = view, summed[k]
    return out, sums


def _named_bucket(named: Sequence[tuple[str, torch.Tensor]], flags: Sequence[float], factor: float
                  ) -> BucketView:
    """A new bucket holding ``factor * tensor`` for each of ``named`` (one dtype), then the flags."""
    numels = [t.numel() for _, t in named]
    total = sum(numels)
    first = named[0][1]
    flat = torch.empty(total + len(named), dtype=first.dtype, device=first.device)
    views, offset = [], 0
    for (_, t), n in zip(named, numels, strict=True):
        view = flat[offset : offset + n]
        torch.mul(t.detach().reshape(-1), factor, out=view)
        views.append(view.view(t.shape))
        offset += n
    flat[total:].copy_(torch.tensor(flags, dtype=flat.dtype))
    return BucketView(flat, total, [n for n, _ in named], views)


def _begin(pset: ProcessSet, sig: Signature, nbytes: int, device: torch.device) -> Op:
    op = pset.coordinator.begin(sig, nbytes)
    op.extra["device"] = device.type
    return op


def _with_residual(bucket: BucketView, state: FeedbackState) -> torch.Tensor:
    """``grad + residual`` of the bucket as one fp32 vector."""
    x = bucket.flat[: bucket.grad_numel].to(torch.float32, copy=True)
    offset = 0
    for name, view in zip(bucket.names, bucket.views, strict=True):
        n = view.numel()
        x[offset : offset + n] += state.residual(name, view).reshape(-1)
        offset += n
    return x


def int8_scatters(numel: int, block: int, size: int) -> bool:
    """Whether an int8 bucket of ``numel`` values over ``size`` ranks takes the two-phase path
    (fewer bytes than the allgather): ``ceil(numel / block) > 2 * ceil(blocks / size)`` blocks.
    The same on every rank (numel, block and size agree)."""
    blocks = _ceil_div(numel, block)
    return blocks > 2 * _ceil_div(blocks, size)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _Int8Reduction:
    """Quantise ``grad + e`` per block; then either allgather every rank's int8 + scales and sum
    dequantised (small buckets, 2 ranks), or reduce-scatter and allgather requantised chunks.

    Two-phase path: the padded blocks are cut into ``N`` chunks of ``c = ceil(blocks / N)``
    blocks; an all-to-all sends chunk ``j`` (int8, scales, and the flags) to rank ``j``, which
    sums the ``N`` dequantised chunks in rank order and quantises the sum again (the same block
    grid); an allgather of those requantised chunks gives every rank the same total. The
    requantisation error of chunk ``j`` joins rank ``j``'s residual, so the residuals still sum
    to everything the wire lost. A rank sends ``2 (N-1) c (block + 4)`` bytes plus ``4 k (N-1)``
    of flags, about ``2 (N-1)/N`` of one int8 payload whatever ``N``.
    """

    def __init__(self, bucket: BucketView, comp: Int8Compressor, state: FeedbackState, pset: ProcessSet,
                 sig: Signature, post_factor: float) -> None:
        self.bucket, self.block, self.pset, self.sig = bucket, comp.block_size, pset, sig
        self.post = post_factor
        n = bucket.grad_numel
        size = pset.size()
        self.state = state  # the residuals are replaced in finish()
        self.extras = bucket.flat.numel() - n
        self.scatter = int8_scatters(n, self.block, size)
        x = _with_residual(bucket, state)
        if self.scatter:
            self.chunk = _ceil_div(_ceil_div(n, self.block), size) * self.block  # values per chunk
            padded = torch.zeros(size * self.chunk, dtype=torch.float32, device=x.device)
            padded[:n] = x
            x = padded
        q, scales = q8.quantize(x, self.block)
        self.lost = x - q8.dequantize(q, scales, x.numel())
        flags = bucket.flat[n:]
        if self.scatter:
            per = self.chunk // self.block
            payload = torch.cat([q8.pack(q[j * self.chunk : (j + 1) * self.chunk],
                                         scales[j * per : (j + 1) * per], flags) for j in range(size)])
            self.received = torch.empty_like(payload)
            self.op = _begin(pset, sig, payload.numel(), payload.device)
            work = dist.all_to_all_single(self.received, payload, group=pset.group_for(payload),
                                          async_op=True)
            state.bytes_sent += (size - 1) * (payload.numel() // size)
        else:
            payload = q8.pack(q, scales, flags)
            self.out = [torch.empty_like(payload) for _ in range(size)]
            self.op = _begin(pset, sig, payload.numel(), payload.device)
            work = dist.all_gather(self.out, payload, group=pset.group_for(payload), async_op=True)
            state.bytes_sent += (size - 1) * payload.numel()
        pset.coordinator.launched(self.op, work)

    def _gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Allgather path: ``(sum, flags)``, fp32, summed in rank order."""
        n, device = self.bucket.grad_numel, self.bucket.flat.device
        total = torch.zeros(n, dtype=torch.float32, device=device)
        flags = torch.zeros(self.extras, dtype=torch.float32, device=device)
        for buf in self.out:  # rank order: the same sum on every rank
            q, scales, extras = q8.unpack(buf, n, self.block, self.extras)
            total += q8.dequantize(q, scales, n)
            flags += extras
        return total, flags

    def _scattered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Two-phase path: ``(sum, flags)``; adds this rank's requantisation error to ``lost``."""
        size, me, c, device = self.pset.size(), self.pset.rank(), self.chunk, self.bucket.flat.device
        mine = torch.zeros(c, dtype=torch.float32, device=device)
        flags = torch.zeros(self.extras, dtype=torch.float32, device=device)
        for buf in self.received.view(size, -1):  # rank order: one sum per chunk owner
            q, scales, extras = q8.unpack(buf, c, self.block, self.extras)
            mine += q8.dequantize(q, scales, c)
            flags += extras
        q, scales = q8.quantize(mine, self.block)
        self.lost[me * c : (me + 1) * c] += mine - q8.dequantize(q, scales, c)
        payload = q8.pack(q, scales, torch.empty(0, device=device))
        out = [torch.empty_like(payload) for _ in range(size)]
        op = _begin(self.pset, Signature(self.sig.kind, f"{self.sig.name}.int8_gather", self.sig.fields),
                    payload.numel(), payload.device)
        work = dist.all_gather(out, payload, group=self.pset.group_for(payload), async_op=True)
        self.pset.coordinator.launched(op, work)
        self.state.bytes_sent += (size - 1) * payload.numel()
        self.pset.coordinator.wait(op)
        parts = [q8.dequantize(*q8.unpack(buf, c, self.block, 0)[:2], c) for buf in out]
        return torch.cat(parts)[: self.bucket.grad_numel], flags

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        self.pset.coordinator.wait(self.op)
        b, n = self.bucket, self.bucket.grad_numel
        total, flags = self._scattered() if self.scatter else self._gathered()
        # A non-finite sum (AMP's GradScaler overflow on some rank: every rank skips the step)
        # keeps the old residuals instead of poisoning every later step; decided on the device.
        finite = torch.isfinite(total).all()
        offset = 0
        for name, view in zip(b.names, b.views, strict=True):
            k = view.numel()
            old = self.state.residual(name, view).reshape(-1)
            kept = torch.where(finite, self.lost[offset : offset + k], old)
            self.state.residuals[name] = kept.view(view.shape)
            offset += k
        if self.post != 1.0:
            total.mul_(self.post)
        b.flat[:n].copy_(total)
        b.flat[n:].copy_(flags)
        return b.flat


class _PowerSGDReduction:
    """Allreduce ``P = M Q`` (with the uncompressed tensors and flags), orthogonalise, allreduce
    ``Q = M^T P``; ``G_hat = P Q^T``, residual ``M - G_hat / N`` (this rank's share).

    While any of the bucket's parameters has been reduced fewer than ``sync_warmup_steps``
    times, the whole bucket travels uncompressed (fp32 sum, residuals and ``Q`` untouched); the
    counts are the same on every rank, so every rank takes the same path."""

    def __init__(self, bucket: BucketView, comp: PowerSGDCompressor, state: FeedbackState,
                 pset: ProcessSet, sig: Signature, post_factor: float) -> None:
        self.bucket, self.comp, self.state, self.pset, self.sig, self.post = (
            bucket, comp, state, pset, sig, post_factor)
        r = comp.rank
        self.mats: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (position, M, Q)
        self.plain: list[int] = []
        p_parts: list[torch.Tensor] = []
        plain_parts: list[torch.Tensor] = []
        warm = any(state.reduced(name) < comp.sync_warmup_steps for name in bucket.names)
        for name in bucket.names:
            state.reductions[name] = state.reduced(name) + 1
        for pos, (name, view) in enumerate(zip(bucket.names, bucket.views, strict=True)):
            shape = None if warm else matrix_shape(view.shape, r, comp.min_compress_numel)
            if shape is None:
                self.plain.append(pos)
                plain_parts.append(view.reshape(-1).to(torch.float32))
                continue
            m = view.to(torch.float32).reshape(shape) + state.residual(name, view).reshape(shape)
            q = state.q.get(name)
            if q is None or q.shape != (shape[1], r):
                q = initial_q(name, shape[1], r, comp.seed, view.device)
            self.mats.append((pos, m, q))
            p_parts.append((m @ q).reshape(-1))
        flags = bucket.flat[bucket.grad_numel :].to(torch.float32)
        self.buf = torch.cat([*p_parts, *plain_parts, flags])
        self.p_numels = [p.numel() for p in p_parts]
        self.op = _begin(pset, sig, self.buf.numel() * 4, self.buf.device)
        work = dist.all_reduce(self.buf, group=pset.group_for(self.buf), async_op=True)
        pset.coordinator.launched(self.op, work)
        state.bytes_sent += _ring_allreduce_bytes(self.buf.numel() * 4, pset.size())

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        self.pset.coordinator.wait(self.op)
        b, state, r = self.bucket, self.state, self.comp.rank
        ps, offset = [], 0
        for (_, m, _), k in zip(self.mats, self.p_numels, strict=True):
            ps.append(orthogonalize_(self.buf[offset : offset + k].view(m.shape[0], r).clone()))
            offset += k
        if self.mats:
            qbuf = torch.cat([(m.T @ p).reshape(-1) for (_, m, _), p in zip(self.mats, ps, strict=True)])
            q_sig = Signature(self.sig.kind, f"{self.sig.name}.powersgd_q", self.sig.fields)
            op = _begin(self.pset, q_sig, qbuf.numel() * 4, qbuf.device)
            work = dist.all_reduce(qbuf, group=self.pset.group_for(qbuf), async_op=True)
            self.pset.coordinator.launched(op, work)
            state.bytes_sent += _ring_allreduce_bytes(qbuf.numel() * 4, self.pset.size())
            self.pset.coordinator.wait(op)
            qoff = 0
            for (pos, m, q_used), p in zip(self.mats, ps, strict=True):
                name, view = b.names[pos], b.views[pos]
                q = qbuf[qoff : qoff + m.shape[1] * r].view(m.shape[1], r).clone()
                qoff += m.shape[1] * r
                approx = p @ q.T
                # non-finite (AMP overflow, a skipped step): keep the old residual and Q
                finite = torch.isfinite(approx).all()
                old_e = state.residual(name, view)
                # ``approx`` is the sum over ranks; this rank's share of it is ``approx / N``, so
                # the residuals sum to exactly what the wire lost (sum_r m_r - approx); keeping
                # ``m - approx`` on every rank would feed back -(N-1) approx next step.
                residual = m - approx / self.pset.size()
                state.residuals[name] = torch.where(finite, residual.view(view.shape), old_e)
                state.q[name] = torch.where(finite, q, q_used)
                view.copy_((approx * self.post).view(view.shape))
        for pos in self.plain:
            view = b.views[pos]
            k = view.numel()
            view.copy_((self.buf[offset : offset + k] * self.post).view(view.shape))
            offset += k
        b.flat[b.grad_numel :].copy_(self.buf[offset:])
        return b.flat


def _ring_allreduce_bytes(nbytes: int, n: int) -> int:
    return 2 * (n - 1) * nbytes // max(1, n)

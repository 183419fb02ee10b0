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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hvd_trainer.comm.ops.checks import Op, Signature
from hvd_trainer.comm.ops.compression import Compressor, Int8Compressor, PowerSGDCompressor
from hvd_trainer.comm.ops.process_set import ProcessSet
from hvd_trainer.comm.reduce.compressed import int8 as q8
from hvd_trainer.comm.reduce.compressed.powersgd import initial_q, matrix_shape, orthogonalize_

__all__ = ["FeedbackState", "BucketView", "start_bucket_reduction"]


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

    def residual(self, name: str, like: torch.Tensor) -> torch.Tensor:
        r = self.residuals.get(name)
        if r is None or r.shape != like.shape or r.device != like.device:
            r = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
            self.residuals[name] = r
        return r

    def state_dict(self) -> dict[str, Any]:
        return {"compressor": self.compressor,
                "residuals": {k: v.clone() for k, v in self.residuals.items()},
                "q": {k: v.clone() for k, v in self.q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("compressor") != self.compressor:
            raise ValueError(
                f"the error-feedback state was saved with compression {state.get('compressor')!r}, "
                f"this reducer uses {self.compressor!r}. HINT: resume with the same compression."
            )
        self.residuals = {k: v.detach().clone().float() for k, v in state["residuals"].items()}
        self.q = {k: v.detach().clone().float() for k, v in state["q"].items()}


@dataclass(slots=True)
class BucketView:
    """What a reduction needs of a bucket."""

    flat: torch.Tensor
    grad_numel: int
    names: list[str]
    views: list[torch.Tensor]


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


class _Int8Reduction:
    """Quantise ``grad + e`` per block, allgather every rank's int8 + scales, sum dequantised."""

    def __init__(self, bucket: BucketView, comp: Int8Compressor, state: FeedbackState, pset: ProcessSet,
                 sig: Signature, post_factor: float) -> None:
        self.bucket, self.block, self.pset, self.post = bucket, comp.block_size, pset, post_factor
        n = bucket.grad_numel
        x = _with_residual(bucket, state)
        q, scales = q8.quantize(x, self.block)
        lost = x - q8.dequantize(q, scales, n)
        self.state, self.lost = state, lost  # the residuals are replaced in finish()
        self.extras = bucket.flat.numel() - n
        payload = q8.pack(q, scales, bucket.flat[n:])
        size = pset.size()
        self.out = [torch.empty_like(payload) for _ in range(size)]
        self.op = _begin(pset, sig, payload.numel(), payload.device)
        work = dist.all_gather(self.out, payload, group=pset.group_for(payload), async_op=True)
        pset.coordinator.launched(self.op, work)
        state.bytes_sent += (size - 1) * payload.numel()

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        self.pset.coordinator.wait(self.op)
        b, n = self.bucket, self.bucket.grad_numel
        total = torch.zeros(n, dtype=torch.float32, device=b.flat.device)
        flags = torch.zeros(self.extras, dtype=torch.float32, device=b.flat.device)
        for buf in self.out:  # rank order: the same sum on every rank
            q, scales, extras = q8.unpack(buf, n, self.block, self.extras)
            total += q8.dequantize(q, scales, n)
            flags += extras
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
    ``Q = M^T P``; ``G_hat = P Q^T``, residual ``M - G_hat``."""

    def __init__(self, bucket: BucketView, comp: PowerSGDCompressor, state: FeedbackState,
                 pset: ProcessSet, sig: Signature, post_factor: float) -> None:
        self.bucket, self.comp, self.state, self.pset, self.sig, self.post = (
            bucket, comp, state, pset, sig, post_factor)
        r = comp.rank
        self.mats: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (position, M, Q)
        self.plain: list[int] = []
        p_parts: list[torch.Tensor] = []
        plain_parts: list[torch.Tensor] = []
        for pos, (name, view) in enumerate(zip(bucket.names, bucket.views, strict=True)):
            shape = matrix_shape(view.shape, r, comp.min_compress_numel)
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
                state.residuals[name] = torch.where(finite, (m - approx).view(view.shape), old_e)
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

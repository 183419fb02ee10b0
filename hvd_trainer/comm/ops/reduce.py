"""The one allreduce path shared by ``allreduce*``, ``grouped_allreduce`` and the gradient reducer.

Steps for a contiguous ``tensor`` reduced in place over a process set of ``N`` ranks:

1. check the signature across ranks (:class:`~hvd_trainer.comm.ops.checks.Coordinator`);
2. scale in the tensor's own precision: ``prescale_factor`` and, for ``Average`` of a floating
   tensor that will be narrowed (fp16/bf16 tensor or compressed wire), ``1/N`` *before* the sum
   so the narrow sum cannot overflow;
3. compress (cast) for the wire; ``fp16`` also applies a global power-of-two scale;
4. launch ``torch.distributed.all_reduce`` asynchronously (``Average`` is sent as ``Sum``);
5. on :meth:`Reduction.finish`: wait (inspected for stalls and mismatches), decompress into
   ``tensor`` and apply what is left of ``1/N`` and ``postscale_factor`` in one pass.

Integer ``Average`` is the exact integer sum divided by ``N`` rounded toward zero, in the input
dtype (``[1, 2] -> 1``, ``[-1, -2] -> -1``); integer scale factors are applied in float64 and
truncated toward zero. ``bool`` supports ``Sum`` (logical or), ``Min``, ``Max`` only.

dtypes the transports lack (int16, uint16, uint32, uint64) travel widened
(:data:`~hvd_trainer.comm.ops.flatten.WIRE_DTYPES`); the division of ``Average`` and the
``postscale_factor`` are applied in the wide dtype before narrowing back, so an int16 average
of ``[30000, 30000]`` is ``30000`` (a sum that overflows the input dtype wraps, as natively).
uint64 travels as its bits and supports ``Sum``, ``Min``, ``Max`` and ``Product`` only, without
scale factors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hvd_trainer.comm.base.errors import CommTypeError
from hvd_trainer.comm.ops.checks import Op, Signature
from hvd_trainer.comm.ops.compression import Compression, Compressor, fp16_scale_exponent
from hvd_trainer.comm.ops.flatten import WIRE_DTYPES, check_dtype, from_wire, to_wire, wire_dtype
from hvd_trainer.comm.ops.ops import ReduceOp
from hvd_trainer.comm.ops.process_set import ProcessSet
from hvd_trainer.comm.world.join_board import Transport

__all__ = ["Reduction", "start_allreduce", "run_identity_allreduce"]

_LOW = (torch.float16, torch.bfloat16)
_TORCH_OP_NAMES = {
    ReduceOp.AVERAGE: "sum",
    ReduceOp.SUM: "sum",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.PRODUCT: "product",
}
_NAME_TO_TORCH = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}


@dataclass(slots=True)
class Reduction:
    """An allreduce in flight. :meth:`finish` waits and writes the result into ``tensor``."""

    tensor: torch.Tensor
    wire: torch.Tensor
    ctx: object
    op: Op
    pset: ProcessSet
    rop: ReduceOp
    post_factor: float
    wire_scale_exp: int
    widened: bool = False
    finished: bool = False

    def poll(self) -> bool:
        """True when the transport has completed (never blocks)."""
        return self.op.done or self.op.work is None or bool(self.op.work.is_completed())

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        if self.finished:
            return self.tensor
        self.pset.coordinator.wait(self.op)
        t, wire = self.tensor, self.wire
        if self.widened:  # finish the integer numerics in the wide dtype, then narrow
            _postprocess(wire, self.rop, self.post_factor, self.pset.size())
            t.copy_(from_wire(wire, t.dtype, _TORCH_OP_NAMES[self.rop]))
        else:
            if wire is not t:
                t.copy_(self.pset_decompress())
            _postprocess(t, self.rop, self.post_factor, self.pset.size())
        self.finished = True
        return t

    def pset_decompress(self) -> torch.Tensor:
        out = self.wire.to(self.tensor.dtype) if self.ctx is not None else self.wire
        if self.wire_scale_exp:
            out = torch.ldexp(out, torch.tensor(-self.wire_scale_exp, dtype=torch.int32, device=out.device))
        return out


def _postprocess(t: torch.Tensor, rop: ReduceOp, post_factor: float, size: int) -> None:
    if t.is_floating_point() or t.is_complex():
        if post_factor != 1.0:
            t.mul_(post_factor)
        return
    if rop is ReduceOp.AVERAGE:
        t.copy_(torch.div(t, size, rounding_mode="trunc"))
    if post_factor != 1.0:
        t.copy_((t.double() * post_factor).to(t.dtype))


def _validate(tensor: torch.Tensor, rop: ReduceOp, scaled: bool) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise CommTypeError(f"allreduce expects a torch.Tensor, got {type(tensor).__name__}.")
    check_dtype(tensor.dtype, "allreduce")
    if tensor.dtype == torch.uint64 and (rop is ReduceOp.AVERAGE or scaled):
        raise CommTypeError(
            f"op={rop.name} (or a scale factor) of a uint64 tensor is not supported. HINT: use Sum, "
            "Min, Max or Product without scale factors, or convert the tensor to int64."
        )
    if tensor.dtype == torch.bool and rop in (ReduceOp.AVERAGE, ReduceOp.PRODUCT):
        raise CommTypeError(
            f"op={rop.name} of a bool tensor is undefined. HINT: use Sum (logical or), Min or Max, "
            "or convert the tensor to an integer dtype."
        )


def signature(
    kind: str, name: str | None, tensor: torch.Tensor, rop: ReduceOp, prescale: float,
    postscale: float, compression: Compressor, extra: tuple = (),
) -> Signature:
    """The cross-rank signature of an allreduce-like collective."""
    return Signature(
        kind,
        name,
        (
            ("op", rop.name),
            ("shape", list(tensor.shape)),
            ("dtype", str(tensor.dtype)),
            ("device", tensor.device.type),
            ("prescale_factor", prescale),
            ("postscale_factor", postscale),
            ("compression", compression.name),
            *extra,
        ),
    )


@torch.no_grad()  # collectives write into parameters and gradients in place
def start_allreduce(
    tensor: torch.Tensor,
    *,
    op: ReduceOp,
    pset: ProcessSet,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Compressor | str | type | None = Compression.none,
    kind: str = "allreduce",
    sig: Signature | None = None,
    prescaled_post_factor: float | None = None,
    launch: Callable[[torch.Tensor, dist.ReduceOp], Any] | None = None,
) -> Reduction:
    """Launch an in-place allreduce of the contiguous ``tensor``; see the module docstring.

    ``launch``: the transport for step 4 instead of ``torch.distributed.all_reduce`` (called with
    the wire tensor and the torch op; returns a ``Work``-like handle with ``wait(timeout)`` and
    ``is_completed()``), e.g. a hierarchical allreduce; every rank must pass the same kind.

    ``prescaled_post_factor``: the caller already multiplied ``tensor`` by
    ``prescale_factor`` (and ``1/N`` for Average), e.g. fused with the copy into a fusion
    bucket; only this factor is applied after the sum.

    Raises:
        CommTypeError: not a tensor, bool Average/Product, or a compressor that
            ``Compression.resolve`` rejects.
        CollectiveMismatchError, JoinedRankError, StallError: from the cross-rank checks.
    """
    with pset.coordinator.local_checks(kind, name):  # a local error still consumes a seq
        compression = Compression.resolve(compression, error=CommTypeError)
        _validate(tensor, op, prescale_factor != 1.0 or postscale_factor != 1.0)
    n = pset.size()
    compress = compression.applies_to(tensor) and op is not ReduceOp.PRODUCT
    global_scale = compress and getattr(compression, "needs_global_scale", False)
    widen = not compress and tensor.dtype in WIRE_DTYPES
    wire_dt = compression.wire_dtype if compress else wire_dtype(tensor.dtype)
    transports: list[Transport] = []
    dev = tensor.device.type
    if global_scale:
        transports.append((1, "torch.float32", "max", dev))
    transports.append((tensor.numel(), str(wire_dt), _TORCH_OP_NAMES[op], dev))
    sig = sig or signature(kind, name, tensor, op, prescale_factor, postscale_factor, compression)
    rec = pset.coordinator.begin(sig, tensor.numel() * tensor.element_size(), transports)
    rec.extra["device"] = tensor.device.type
    group = pset.group_for(tensor)
    if prescaled_post_factor is None:
        pre, post = _split_factors(tensor, op, n, prescale_factor, postscale_factor, compress)
        _prescale(tensor, pre)
    else:
        post = prescaled_post_factor
    exp = 0
    if global_scale:
        exp = _global_exponent(tensor, op, n, pset, rec)
    wire, ctx = tensor, None
    if compress:
        ctx = tensor.dtype
        wire = _scaled_cast(tensor, exp, wire_dt) if exp else tensor.to(wire_dt)
    elif widen:
        wire = to_wire(tensor, _TORCH_OP_NAMES[op])
    torch_op = _NAME_TO_TORCH[_TORCH_OP_NAMES[op]]
    if launch is not None:
        work = launch(wire, torch_op)
    else:
        work = dist.all_reduce(wire, op=torch_op, group=group, async_op=True)
    pset.coordinator.launched(rec, work)
    return Reduction(tensor, wire, ctx, rec, pset, op, post, exp, widened=widen)


def _split_factors(
    tensor: torch.Tensor, op: ReduceOp, n: int, pre: float, post: float, compress: bool
) -> tuple[float, float]:
    """(factor applied before the sum, factor applied after) for floating tensors."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return pre, post
    if op is ReduceOp.AVERAGE:
        if compress or tensor.dtype in _LOW:
            return pre / n, post  # divide first: a narrow sum can overflow
        return pre, post / n
    return pre, post


def _prescale(tensor: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:
        tensor.copy_((tensor.double() * factor).to(tensor.dtype))


def _global_exponent(tensor: torch.Tensor, op: ReduceOp, n: int, pset: ProcessSet, rec: Op) -> int:
    if tensor.numel():
        local = tensor.detach().abs().amax().float().reshape(1)
    else:
        local = tensor.new_zeros(1, dtype=torch.float32)
    local = torch.nan_to_num(local, nan=0.0, posinf=0.0)
    work = dist.all_reduce(local, op=dist.ReduceOp.MAX, group=pset.group_for(tensor), async_op=True)
    pset.coordinator.wait_work(rec, work)
    terms = n if op in (ReduceOp.SUM, ReduceOp.AVERAGE) else 1
    return fp16_scale_exponent(float(local.item()), terms)


def _scaled_cast(tensor: torch.Tensor, exp: int, wire_dtype: torch.dtype) -> torch.Tensor:
    scaled = torch.ldexp(tensor.float(), torch.tensor(exp, dtype=torch.int32, device=tensor.device))
    return scaled.to(wire_dtype)


def identity_tensor(transport: Transport, device: torch.device) -> torch.Tensor:
    """What a joined rank contributes: the identity element of the op (zeros for Sum)."""
    numel, dtype_name, op, _ = transport
    dtype = getattr(torch, dtype_name.replace("torch.", ""))
    if op == "sum":
        return torch.zeros(numel, dtype=dtype, device=device)
    if op == "product":
        return torch.ones(numel, dtype=dtype, device=device)
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    fill = info.max if op == "min" else info.min
    if dtype.is_floating_point:
        fill = float("inf") if op == "min" else float("-inf")
    return torch.full((numel,), fill, dtype=dtype, device=device)


def run_identity_allreduce(transport: Transport, pset: ProcessSet) -> None:
    """Take part in one announced transport allreduce with the identity element; wait for it."""
    device = torch.device("cpu") if transport[3] == "cpu" else pset.device
    t = identity_tensor(transport, device)
    dist.all_reduce(t, op=_NAME_TO_TORCH[transport[2]], group=pset.group_for(t))

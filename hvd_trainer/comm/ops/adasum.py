"""Adasum: adaptive summation of gradients (``op=hvd.Adasum``).

Maleki et al. 2021, "Adasum: Adaptive Summation of Gradients for Deep Learning Optimization"
(arXiv:2006.02924), section 3: two gradients ``a`` and ``b`` combine as

    adasum(a, b) = (1 - a·b / (2‖a‖²)) · a + (1 - a·b / (2‖b‖²)) · b

so orthogonal gradients are summed (``a·b = 0``), identical ones averaged (``adasum(g, g) = g``),
and anything between is interpolated. As in Horovod, the dot product and norms are taken *per
tensor* (per layer): in a grouped allreduce or a fused gradient buffer each tensor's slice is
combined with its own coefficients. A zero vector contributes nothing (``adasum(0, b) = b``).

**More than two ranks.** The ranks' vectors ``v_0 .. v_{N-1}`` (in the process set's rank
order) are combined along a binary tree, level by level: neighbours ``(v_0, v_1), (v_2, v_3),
...`` are combined, and a vector left without a neighbour (odd count) moves up a level
unchanged; this repeats until one vector is left. For a power-of-two ``N`` this is the pairing
of Horovod's recursive doubling (rank ``r`` with ``r XOR 2^k`` at level ``k``); for any other
``N`` it is the same tree with the missing leaves absent, e.g. ``N = 3`` gives
``adasum(adasum(v_0, v_1), v_2)``. Both properties hold for any ``N``: identical inputs give that
input, pairwise-orthogonal inputs give their sum. Horovod requires MPI and a power of two; this
needs neither.

**Transport.** Every rank gathers all ``N`` vectors (one ``all_gather`` on the set's group,
gloo or NCCL) and evaluates the same tree on the same data in the same order, so the result is
bitwise identical on every rank. Memory and traffic are ``N ×`` the tensor's size, which suits
the few-to-tens of ranks that Adasum is used with; dot products and norms are accumulated in
float64, the combination is computed in float32 (float64 for float64 tensors) and cast back.

Floating dtypes only (float16, bfloat16, float32, float64). ``prescale_factor`` multiplies each
rank's input, ``postscale_factor`` the result. Compression (``fp16``/``bf16``) casts the inputs
for the wire. A rank that has called ``join()`` cannot take part (``JoinedRankError``).
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

__all__ = ["ADASUM_DTYPES", "adasum_pair", "adasum_tree", "AdasumReduction", "start_adasum"]

ADASUM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes Adasum combines (it needs dot products and norms)."""

Segments = Sequence[tuple[int, int]]
"""``(offset, numel)`` of each tensor inside a flat 1-D buffer."""


def _coefficient(dot: torch.Tensor, norm_sq: torch.Tensor) -> torch.Tensor:
    """``1 - dot / (2 norm_sq)``, and 1 where the vector is zero (its term is zero anyway)."""
    safe = torch.where(norm_sq > 0, norm_sq, torch.ones_like(norm_sq))
    return torch.where(norm_sq > 0, 1.0 - dot / (2.0 * safe), torch.ones_like(norm_sq))


def adasum_pair(a: torch.Tensor, b: torch.Tensor, segments: Segments | None = None) -> torch.Tensor:
    """Combine two flat vectors with Adasum, each segment with its own coefficients.

    Args:
        a, b: 1-D floating tensors of the same shape and dtype (float32 or float64 here; the
            caller upcasts narrow dtypes).
        segments: ``(offset, numel)`` per tensor, covering ``a``; ``None``: one segment.

    Returns:
        A new 1-D tensor like ``a``.
    """
    if segments is None:
        segments = [(0, a.numel())]
    out = torch.empty_like(a)
    for start, numel in segments:
        x, y = a[start : start + numel], b[start : start + numel]
        x64, y64 = x.double(), y.double()
        dot = torch.dot(x64, y64)
        ca = _coefficient(dot, torch.dot(x64, x64)).to(a.dtype)
        cb = _coefficient(dot, torch.dot(y64, y64)).to(a.dtype)
        torch.add(x * ca, y * cb, out=out[start : start + numel])
    return out


def adasum_tree(vectors: Sequence[torch.Tensor], segments: Segments | None = None) -> torch.Tensor:
    """Combine ``N >= 1`` flat vectors along the binary tree of the module docstring.

    Raises:
        ValueError: an empty list.
    """
    level = list(vectors)
    if not level:
        raise ValueError("adasum_tree needs at least one vector.")
    while len(level) > 1:
        nxt = [adasum_pair(level[i], level[i + 1], segments) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(slots=True)
class AdasumReduction:
    """An Adasum in flight. :meth:`finish` waits and writes the result into ``tensor``."""

    tensor: torch.Tensor
    gathered: list[torch.Tensor]
    segments: Segments
    op: Op
    pset: ProcessSet
    postscale_factor: float
    finished: bool = False

    def poll(self) -> bool:
        """True when the transport has completed (never blocks)."""
        return self.op.done or self.op.work is None or bool(self.op.work.is_completed())

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        if self.finished:
            return self.tensor
        self.pset.coordinator.wait(self.op)
        cdt = _compute_dtype(self.tensor.dtype)
        result = adasum_tree([g.to(cdt) for g in self.gathered], self.segments)
        if self.postscale_factor != 1.0:
            result.mul_(self.postscale_factor)
        self.tensor.copy_(result.view_as(self.tensor))
        self.finished = True
        return self.tensor


def _validate(tensor: torch.Tensor, segments: Segments) -> None:
    if tensor.dtype not in ADASUM_DTYPES:
        raise CommTypeError(
            f"op=Adasum needs a floating tensor, got {tensor.dtype}. HINT: Adasum combines "
            "gradients by their dot products; use Sum or Average for integer or complex tensors."
        )
    covered = sum(n for _, n in segments)
    if covered != tensor.numel():
        raise ValueError(f"Adasum segments cover {covered} elements of a {tensor.numel()}-element buffer.")


@torch.no_grad()
def start_adasum(
    tensor: torch.Tensor,
    *,
    pset: ProcessSet,
    sig: Signature,
    name: str | None = None,
    segments: Segments | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Compressor | str | type | None = Compression.none,
    kind: str = "allreduce",
) -> AdasumReduction:
    """Launch Adasum of the contiguous ``tensor`` over ``pset`` (in place on :meth:`finish`).

    Args:
        tensor: a contiguous floating tensor, same shape and dtype on every rank.
        sig: the cross-rank signature (it must name ``op=ADASUM`` and the segment layout).
        segments: ``(offset, numel)`` per tensor of a flat buffer; ``None``: the whole tensor.

    Raises:
        CommTypeError: a non-floating dtype or a compressor that ``Compression.resolve`` rejects.
        CollectiveMismatchError, JoinedRankError, StallError: from the cross-rank checks.
    """
    with pset.coordinator.local_checks(kind, name):  # a local error still consumes a seq
        compression = Compression.resolve(compression, error=CommTypeError)
        segs = list(segments) if segments is not None else [(0, tensor.numel())]
        _validate(tensor, segs)
    rec = pset.coordinator.begin(sig, tensor.numel() * tensor.element_size(), None)
    rec.extra["device"] = tensor.device.type
    flat = tensor.reshape(-1)
    if prescale_factor != 1.0:
        flat = flat * prescale_factor
    if compression.applies_to(tensor):
        flat = flat.to(compression.wire_dtype)
    flat = flat.contiguous()
    gathered = [torch.empty_like(flat) for _ in range(pset.size())]
    work = dist.all_gather(gathered, flat, group=pset.group_for(tensor), async_op=True)
    pset.coordinator.launched(rec, work)
    return AdasumReduction(tensor, gathered, segs, rec, pset, postscale_factor)

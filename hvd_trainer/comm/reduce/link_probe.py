"""How fast the ranks' link is, measured once, and the bucket cap it implies.

On a slow link a large bucket is a long wait: the last bucket of backward can only start when
backward ends, and everything in it is exposed. Small buckets let the link start early and keep
it busy while backward runs; on a fast link each collective's fixed cost (~0.1-0.5 ms for gloo)
makes many small buckets slower instead. So the cap is a *time* on the wire, converted to bytes
with the measured bandwidth: ``cap = clamp(bandwidth x bucket_seconds, min_bytes, max_bytes)``.

The probe (:func:`probe_link`) times a small and a large allreduce (best of ``repeats`` each,
fp32, over the given process set; a 4-byte allreduce before each timed one lines the ranks up,
so a rank still busy elsewhere is not timed as link), agrees across ranks on the slowest rank's
times (one more 16-byte allreduce) and fits ``t = latency + bytes / bandwidth`` through the two
points (:func:`fit_link`), so every rank derives the same estimate and the same bucket layout.
At 20 Mbit/s it costs ~0.3 s, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hvd_trainer.comm.ops.ops import ReduceOp
from hvd_trainer.comm.ops.process_set import ProcessSet
from hvd_trainer.comm.ops.reduce import start_allreduce

__all__ = ["LinkEstimate", "bucket_cap_bytes", "fit_link", "probe_link", "time_paths"]

_SMALL_BYTES = 8 * 1024
_LARGE_BYTES = 256 * 1024


@dataclass(frozen=True)
class LinkEstimate:
    """The allreduce path between the ranks, as measured.

    Attributes:
        bytes_per_s: allreduce algorithm bandwidth (message bytes per second; for a 2-rank ring
            about the link's one-way goodput).
        latency_s: fixed cost of one allreduce, seconds.
    """

    bytes_per_s: float
    latency_s: float


def _best_seconds(t: torch.Tensor, pset: ProcessSet, name: str, repeats: int,
                  launch: Callable[[torch.Tensor, Any], Any] | None = None) -> float:
    best = float("inf")
    line_up = torch.zeros(1, device=t.device)
    for _ in range(repeats):
        start_allreduce(line_up, op=ReduceOp.SUM, pset=pset, name=f"{name}.line_up",
                        kind="link_probe").finish()
        start = time.perf_counter()
        start_allreduce(t, op=ReduceOp.SUM, pset=pset, name=name, kind="link_probe", launch=launch).finish()
        best = min(best, time.perf_counter() - start)
    return best


def probe_link(pset: ProcessSet, device: torch.device, repeats: int = 2) -> LinkEstimate:
    """Measure the allreduce bandwidth and latency between the members of ``pset``.

    Collective: every member must call it at the same point (it issues ``4 * repeats + 3``
    allreduces). Returns the same estimate on every member.
    """
    small = torch.zeros(_SMALL_BYTES // 4, device=device)
    large = torch.zeros(_LARGE_BYTES // 4, device=device)
    _best_seconds(small, pset, "link_probe.warmup", 1)
    times = torch.tensor([_best_seconds(small, pset, "link_probe.small", repeats),
                          _best_seconds(large, pset, "link_probe.large", repeats)], dtype=torch.float64)
    start_allreduce(times, op=ReduceOp.MAX, pset=pset, name="link_probe.agree", kind="link_probe").finish()
    return fit_link(float(times[0]), float(times[1]))


def fit_link(t_small: float, t_large: float, small_bytes: int = _SMALL_BYTES,
             large_bytes: int = _LARGE_BYTES) -> LinkEstimate:
    """The line ``t = latency + bytes / bandwidth`` through ``(small_bytes, t_small)`` and
    ``(large_bytes, t_large)`` (seconds, bytes).

    When the large allreduce was not slower than the small one (a timing disturbed by the
    scheduler: the two points say nothing of the slope), the estimate is the large one's plain
    rate, ``large_bytes / t_large`` with no latency: a lower bound on the bandwidth, never the
    unbounded figure a near-zero slope would give.
    """
    if not large_bytes > small_bytes > 0 or t_large <= 0:
        raise ValueError(f"fit_link needs large_bytes > small_bytes > 0 and t_large > 0, got "
                         f"{small_bytes}, {large_bytes} bytes and t_large={t_large} s")
    if t_large <= t_small:
        return LinkEstimate(bytes_per_s=large_bytes / t_large, latency_s=0.0)
    slope = (t_large - t_small) / (large_bytes - small_bytes)
    return LinkEstimate(bytes_per_s=1.0 / slope, latency_s=max(t_small - small_bytes * slope, 0.0))


def bucket_cap_bytes(link: LinkEstimate, bucket_seconds: float, min_bytes: int, max_bytes: int) -> int:
    """``clamp(link.bytes_per_s * bucket_seconds, min_bytes, max_bytes)``, bytes."""
    return int(min(max(link.bytes_per_s * bucket_seconds, min_bytes), max_bytes))


def time_paths(pset: ProcessSet, device: torch.device, launch: Callable[[torch.Tensor, Any], Any],
               nbytes: int = _LARGE_BYTES, repeats: int = 2) -> tuple[float, float]:
    """``(flat_seconds, other_seconds)``: the best of ``repeats`` allreduces of ``nbytes`` (fp32)
    through ``torch.distributed.all_reduce`` and through ``launch``, the slowest rank's, agreed.

    Collective, like :func:`probe_link`; every member gets the same pair (so the same choice).
    """
    t = torch.zeros(nbytes // 4, device=device)
    _best_seconds(t, pset, "link_probe.other_warmup", 1, launch)
    times = torch.tensor([_best_seconds(t, pset, "link_probe.flat", repeats),
                          _best_seconds(t, pset, "link_probe.other", repeats, launch)], dtype=torch.float64)
    agree = start_allreduce(times, op=ReduceOp.MAX, pset=pset, name="link_probe.agree_paths",
                            kind="link_probe")
    agree.finish()
    return float(times[0]), float(times[1])

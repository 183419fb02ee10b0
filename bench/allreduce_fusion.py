"""Fused gradient allreduce vs the link's limit, on ResNet-50's 161 gradient shapes.

Run (2 gloo processes on this machine; no torchvision needed):

    PYTHONPATH=. python bench/allreduce_fusion.py            # default thresholds sweep
    PYTHONPATH=. python bench/allreduce_fusion.py --reps 7

In one run, interleaved per repetition so machine noise hits every variant alike:

(a) ``flat``: one ``all_reduce`` of a single 25,557,032-element fp32 tensor (102.2 MB), the
    limit of this link;
(b) ``per_tensor``: one blocking ``all_reduce`` per gradient (161 calls), unfused;
(c) ``fused``: :class:`GradientReducer` driven by real autograd hooks: ``loss.backward()`` on
    parameters of exactly ResNet-50's shapes, then ``reducer.wait()``. Its time is the step
    (backward + wait) minus the same backward without a reducer, i.e. what the reducer adds.
    Measured after ``zero_grad(set_to_none=True)`` (grads copied into buckets, scaled in the
    same pass) and, for the default threshold, with grads kept as bucket views
    (``zero_grad(set_to_none=False)``: autograd accumulates in place, nothing is copied).

Prints ``RATIO fused_vs_flat=<x> per_tensor_vs_flat=<y>`` for the default threshold, one
``SWEEP`` line per threshold, and ``CHECK_OVERHEAD`` (cost of the cached cross-rank signature
check per step, measured directly and as a fraction of the fused step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

try:
    from tests.multiproc import run_workers
except ImportError:  # run from elsewhere
    sys.path.insert(0, ".")
    from tests.multiproc import run_workers

_MIB = 1024 * 1024


def resnet50_shapes() -> list[tuple[int, ...]]:
    """The 161 parameter shapes of torchvision's ResNet-50, in ``named_parameters()`` order."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]  # conv1, bn1
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,)]
            shapes += [(planes, planes, 3, 3), (planes,), (planes,)]
            shapes += [(planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:  # downsample: 1x1 conv + bn
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    shapes += [(1000, 2048), (1000,)]  # fc
    return shapes


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class _Workload:
    """Parameters of ResNet-50's shapes, a backward that fills their gradients, and reducers."""

    def __init__(self, world, thresholds: list[int]) -> None:
        from hvd_trainer.comm import FusionConfig, GradientReducer

        shapes = resnet50_shapes()
        self.params = [torch.zeros(s, requires_grad=True) for s in shapes]
        self.coeffs = [torch.full(s, 1.0 + i / 1000) for i, s in enumerate(shapes)]
        self.flat = torch.ones(sum(p.numel() for p in self.params))
        self.grads = [torch.ones(s) for s in shapes]
        named = [(f"p{i}", p) for i, p in enumerate(self.params)]
        self.reducers = {}
        for th in thresholds:
            cfg = FusionConfig(fusion_threshold_bytes=th, first_bucket_bytes=_MIB)
            self.reducers[th] = GradientReducer(named, world=world, config=cfg)
            self.reducers[th].remove()  # hooks are registered only while measured

    def backward(self) -> None:
        loss = sum((p * c).sum() for p, c in zip(self.params, self.coeffs, strict=True))
        loss.backward()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None  # zero_grad(set_to_none=True), the default

    def plain_backward(self) -> float:
        self.zero_grad()
        return _timed(self.backward)

    def fused(self, th: int, set_to_none: bool = True) -> float:
        red = self.reducers[th]
        red._handles = [p.register_post_accumulate_grad_hook(red._on_grad_ready) for p in self.params]
        if set_to_none:
            self.zero_grad()
        else:  # zero_grad(set_to_none=False) before the step: grads stay bucket views
            self.fused_warm(red)
        t = _timed(lambda: (self.backward(), red.wait()))
        red.remove()
        return t

    def fused_warm(self, red) -> None:
        for b in red._buckets:
            b.flat.zero_()
            for p, v in zip(b.params, b.views, strict=True):
                p.grad = v

    def plain_backward_inplace(self) -> float:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
        return _timed(self.backward)


def _sample(w: _Workload, thresholds: list[int], default_threshold: int, cfg) -> dict[str, float]:
    import torch.distributed as dist

    sample = {
        "flat": _timed(lambda: dist.all_reduce(w.flat)),
        "per_tensor": _timed(lambda: [dist.all_reduce(g) for g in w.grads]),
        "backward": w.plain_backward(),
    }
    for th in thresholds:
        sample[f"fused_{th}"] = w.fused(th)
    cfg.check_signatures = False
    sample["fused_nocheck"] = w.fused(default_threshold)
    cfg.check_signatures = True
    sample["backward_inplace"] = w.plain_backward_inplace()
    sample["fused_inplace"] = w.fused(default_threshold, set_to_none=False)
    return sample


def _bench(reps: int, thresholds: list[int], default_threshold: int) -> dict:
    import hvd_trainer as hvd

    world = hvd.get_world()
    w = _Workload(world, thresholds)
    samples = [_sample(w, thresholds, default_threshold, world.runtime.config) for _ in range(reps + 1)]
    samples = samples[1:]  # the first repetition warms up (and fills the signature cache)
    times = {k: [s[k] for s in samples] for k in samples[0]}
    # Per-collective bookkeeping incl. the cached signature check (begin + settle), measured
    # directly with a real bucket signature; both ranks make the same calls, so they stay in step.
    coord = world.runtime.global_set.coordinator
    bucket_sig = w.reducers[thresholds[0]]._buckets[0].sig
    n_calls = 2000

    def bookkeeping() -> None:
        for _ in range(n_calls):
            coord.settle(coord.begin(bucket_sig, 0))

    bookkeeping()  # the first call checks the pair (bucket_sig, bucket_sig) once
    t_check = _timed(bookkeeping) / n_calls
    return {"median": {k: statistics.median(v) for k, v in times.items()},
            "min": {k: min(v) for k, v in times.items()},
            "n_buckets": {th: len(r.bucket_sizes_bytes) for th, r in w.reducers.items()},
            "t_check": t_check, "checks": coord.checks_run, "check_seconds": coord.check_seconds_total}


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--thresholds-mib", type=float, nargs="+", default=[4, 16, 25, 64, 128])
    args = parser.parse_args()
    shapes = resnet50_shapes()
    total = sum(torch.Size(s).numel() for s in shapes)
    assert len(shapes) == 161 and total == 25_557_032, (len(shapes), total)
    from hvd_trainer.comm.base.config import DEFAULT_FUSION_THRESHOLD_BYTES

    thresholds = sorted({int(m * _MIB) for m in args.thresholds_mib} | {DEFAULT_FUSION_THRESHOLD_BYTES})
    res = run_workers(_bench, 2, args=(args.reps, thresholds, DEFAULT_FUSION_THRESHOLD_BYTES),
                      timeout_seconds=1800)[0]
    print(f"shapes={len(shapes)} params={total} bytes={total * 4} reps={args.reps}")
    for stat in ("median", "min"):
        t = res[stat]
        print(f"[{stat}] flat={t['flat'] * 1e3:.1f}ms per_tensor={t['per_tensor'] * 1e3:.1f}ms "
              f"backward_alone={t['backward'] * 1e3:.1f}ms")
        for th in thresholds:
            step = t[f"fused_{th}"]
            print(f"[{stat}] SWEEP threshold={th / _MIB:g}MiB buckets={res['n_buckets'][th]} "
                  f"step={step * 1e3:.1f}ms fused_vs_flat={(step - t['backward']) / t['flat']:.3f}")
        fused = t[f"fused_{DEFAULT_FUSION_THRESHOLD_BYTES}"] - t["backward"]
        print(f"[{stat}] RATIO fused_vs_flat={fused / t['flat']:.3f} "
              f"per_tensor_vs_flat={t['per_tensor'] / t['flat']:.3f}")
        inplace = t["fused_inplace"] - t["backward_inplace"]
        print(f"[{stat}] zero_grad(set_to_none=False) (no copy in): fused_vs_flat={inplace / t['flat']:.3f} "
              f"(step={t['fused_inplace'] * 1e3:.1f}ms backward={t['backward_inplace'] * 1e3:.1f}ms)")
    med = res["median"]
    step_on = med[f"fused_{DEFAULT_FUSION_THRESHOLD_BYTES}"]
    per_step = res["t_check"] * res["n_buckets"][DEFAULT_FUSION_THRESHOLD_BYTES]
    print(f"CHECK_OVERHEAD cached_check_per_collective={res['t_check'] * 1e6:.2f}us "
          f"per_step={per_step * 1e6:.1f}us ({per_step / step_on * 100:.4f}% of the fused step); "
          f"first-time checks={res['checks']} took {res['check_seconds'] * 1e3:.1f}ms in total; "
          f"median fused step checks off={med['fused_nocheck'] * 1e3:.1f}ms on={step_on * 1e3:.1f}ms")


if __name__ == "__main__":
    main()

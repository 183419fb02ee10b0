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


def _bench(reps: int, thresholds: list[int], default_threshold: int) -> dict:
    import torch.distributed as dist

    import hvd_trainer as hvd
    from hvd_trainer.comm import FusionConfig, GradientReducer

    world = hvd.get_world()
    shapes = resnet50_shapes()
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    coeffs = [torch.full(s, 1.0 + i / 1000) for i, s in enumerate(shapes)]
    total = sum(p.numel() for p in params)
    flat = torch.ones(total)
    grads = [torch.ones(s) for s in shapes]

    def backward() -> None:
        loss = sum((p * c).sum() for p, c in zip(params, coeffs, strict=True))
        loss.backward()

    reducers = {}
    for th in thresholds:
        r = GradientReducer([(f"p{i}", p) for i, p in enumerate(params)], world=world,
                            config=FusionConfig(fusion_threshold_bytes=th, first_bucket_bytes=_MIB))
        r.remove()  # re-registered only while measured
        reducers[th] = r

    def fused(th: int) -> float:
        red = reducers[th]
        red._handles = [p.register_post_accumulate_grad_hook(red._on_grad_ready) for p in params]
        for p in params:
            p.grad = None  # zero_grad(set_to_none=True): the hook copies each grad in once
        t = _timed(lambda: (backward(), red.wait()))
        red.remove()
        return t

    def plain_backward() -> float:
        for p in params:
            p.grad = None
        return _timed(backward)

    times: dict[str, list[float]] = {"flat": [], "per_tensor": [], "backward": []}
    for th in thresholds:
        times[f"fused_{th}"] = []
    cfg = world.runtime.config
    times["fused_nocheck"] = []
    for rep in range(reps + 1):  # first repetition warms up (and fills the signature cache)
        sample = {
            "flat": _timed(lambda: dist.all_reduce(flat)),
            "per_tensor": _timed(lambda: [dist.all_reduce(g) for g in grads]),
            "backward": plain_backward(),
        }
        for th in thresholds:
            sample[f"fused_{th}"] = fused(th)
        cfg.check_signatures = False
        sample["fused_nocheck"] = fused(default_threshold)
        cfg.check_signatures = True
        if rep:
            for k, v in sample.items():
                times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    # Per-collective bookkeeping incl. the cached signature check (begin + settle), measured
    # directly with a real bucket signature; both ranks make the same calls, so they stay in step.
    coord = world.runtime.global_set.coordinator
    bucket_sig = reducers[thresholds[0]]._buckets[0].sig
    n_calls = 2000

    def bookkeeping() -> None:
        for _ in range(n_calls):
            coord.settle(coord.begin(bucket_sig, 0))

    bookkeeping()  # first call checks (bucket_sig after bucket_sig) once, then it is cached
    t_check = _timed(bookkeeping) / n_calls
    return {"median": med, "n_buckets": {th: len(r.bucket_sizes_bytes) for th, r in reducers.items()},
            "total": total, "t_check": t_check, "checks": coord.checks_run,
            "check_seconds": coord.check_seconds_total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--thresholds-mib", type=float, nargs="+", default=[4, 16, 25, 64, 128])
    args = parser.parse_args()
    shapes = resnet50_shapes()
    total = sum(torch.Size(s).numel() for s in shapes)
    assert len(shapes) == 161 and total == 25_557_032, (len(shapes), total)
    from hvd_trainer.comm.config import DEFAULT_FUSION_THRESHOLD_BYTES

    thresholds = sorted({int(m * _MIB) for m in args.thresholds_mib} | {DEFAULT_FUSION_THRESHOLD_BYTES})
    res = run_workers(_bench, 2, args=(args.reps, thresholds, DEFAULT_FUSION_THRESHOLD_BYTES),
                      timeout_seconds=1800)[0]
    med = res["median"]
    flat, backward = med["flat"], med["backward"]
    print(f"shapes={len(shapes)} params={total} bytes={total * 4} reps={args.reps}")
    print(f"flat={flat * 1e3:.1f}ms per_tensor={med['per_tensor'] * 1e3:.1f}ms "
          f"backward_alone={backward * 1e3:.1f}ms")
    for th in thresholds:
        step = med[f"fused_{th}"]
        print(f"SWEEP threshold={th // _MIB}MiB buckets={res['n_buckets'][th]} step={step * 1e3:.1f}ms "
              f"fused_vs_flat={(step - backward) / flat:.3f}")
    fused_default = med[f"fused_{DEFAULT_FUSION_THRESHOLD_BYTES}"] - backward
    print(f"RATIO fused_vs_flat={fused_default / flat:.3f} per_tensor_vs_flat={med['per_tensor'] / flat:.3f}")
    n_b = res["n_buckets"][DEFAULT_FUSION_THRESHOLD_BYTES]
    per_step = res["t_check"] * n_b
    print(f"CHECK_OVERHEAD cached_check_per_collective={res['t_check'] * 1e6:.2f}us "
          f"per_step={per_step * 1e6:.1f}us ({per_step / med[f'fused_{DEFAULT_FUSION_THRESHOLD_BYTES}'] * 100:.4f}% "
          f"of the fused step); first-time checks={res['checks']} "
          f"took {res['check_seconds'] * 1e3:.1f}ms in total; fused step with checks off="
          f"{med['fused_nocheck'] * 1e3:.1f}ms vs on={med[f'fused_{DEFAULT_FUSION_THRESHOLD_BYTES}'] * 1e3:.1f}ms")


if __name__ == "__main__":
    main()

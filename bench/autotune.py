"""Autotuned bucket layout vs the best fixed fusion threshold of a sweep, in one run.

Run (2 gloo processes on this machine):

    PYTHONPATH=. python bench/autotune.py               # 5 interleaved repetitions
    PYTHONPATH=. python bench/autotune.py --reps 7 --steps 10

Two workloads, each a real training step (``zero_grad``, forward/backward, the
``DistributedOptimizer``'s fused allreduce, ``SGD.step``):

* ``resnet50``: parameters of exactly ResNet-50's 161 shapes (102 MB of fp32 gradients, see
  ``bench/allreduce_fusion.py``) with a cheap elementwise loss, so the step is mostly the
  gradient traffic;
* ``mlp``: a 4-layer MLP (2048 wide, 21 MB of gradients) on random batches.

Per repetition and workload: each fixed threshold of the sweep (1, 4, 16, 64, 256 MiB; first
bucket 1 MiB) runs ``--steps`` timed steps after 2 untimed ones; then an optimizer with
``FusionConfig(autotune=...)`` trains until the search has chosen, and runs ``--steps`` timed
steps on its choice. A step's time is rank 0's wall time (the ranks run in lock step). Prints one
``SAMPLE`` line per repetition, then per workload ``RATIO autotune_vs_best_fixed_<w>=<x>``: the
median over repetitions of (autotuned median step) / (median step of the sweep's best fixed
threshold, measured again right after the autotuned run), and ``RATIO autotune_vs_best_fixed=<x>``,
the larger of the two. Goal: <= 1.05. The best threshold is re-measured because the sweep's own
time for it is the minimum of five noisy measurements, biased low (the winner's curse; on the
MLP all thresholds are within noise of each other, so the minimum is mostly noise); the ratio
against that minimum is printed too. All ranks pick the threshold from the slowest rank's
sweep times, so they build the same buckets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

try:
    from tests.multiproc import run_workers
except ImportError:  # run from elsewhere
    sys.path.insert(0, ".")
    from tests.multiproc import run_workers

sys.path.insert(0, "bench")
from allreduce_fusion import resnet50_shapes  # noqa: E402

_MIB = 1024 * 1024
SWEEP_MIB = (1, 4, 16, 64, 256)


class _Resnet50Shapes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shapes = resnet50_shapes()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])
        self.cs = [torch.full(s, 1.0 + i / 1000) for i, s in enumerate(shapes)]

    def loss(self, step: int) -> torch.Tensor:
        return sum((p * c).sum() for p, c in zip(self.ps, self.cs, strict=True))


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
            torch.nn.Linear(2048, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10),
        )

    def loss(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(64, 512, generator=gen), torch.randint(0, 10, (64,), generator=gen)
        return torch.nn.functional.cross_entropy(self.net(x), y)


def _step(model, opt, step: int) -> float:
    t0 = time.perf_counter()
    opt.zero_grad()
    model.loss(step).backward()
    opt.step()
    return time.perf_counter() - t0


def _optimizer(model, fusion_config):
    import hvd_trainer as hvd

    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6),
                                    named_parameters=model.named_parameters(), fusion_config=fusion_config)


def _fixed(model, threshold: int, steps: int) -> float:
    from hvd_trainer.comm import FusionConfig

    opt = _optimizer(model, FusionConfig(fusion_threshold_bytes=threshold, first_bucket_bytes=_MIB,
                                         autotune=None))
    for s in range(2):
        _step(model, opt, s)
    t = statistics.median(_step(model, opt, s) for s in range(steps))
    opt.remove_hooks()
    return t


def _autotuned(model, steps: int) -> tuple[float, int, int]:
    from hvd_trainer.comm import AutotuneConfig, FusionConfig

    tune = AutotuneConfig(warmup_samples=1, steps_per_sample=5, warmup_steps_per_sample=1)
    opt = _optimizer(model, FusionConfig(autotune=tune))
    search_steps = 0
    _step(model, opt, 0)  # builds the reducer
    while not opt._reducer.autotuner.done and search_steps < 1000:
        _step(model, opt, search_steps)
        search_steps += 1
    t = statistics.median(_step(model, opt, s) for s in range(steps))
    threshold = opt._reducer.autotuner.best.fusion_threshold_bytes
    opt.remove_hooks()
    return t, threshold, search_steps


def _agreed_best(fixed: dict[int, float]) -> int:
    """The sweep's fastest threshold (MiB) by the slowest rank's times, the same on every rank."""
    import hvd_trainer as hvd

    times = hvd.allreduce(torch.tensor(list(fixed.values()), dtype=torch.float64), op=hvd.Max)
    return list(fixed)[int(times.argmin())]


def _bench(reps: int, steps: int) -> list[dict]:
    torch.manual_seed(0)
    models = {"resnet50": _Resnet50Shapes(), "mlp": _Mlp()}
    out = []
    for _ in range(reps):
        rep: dict = {}
        for name, model in models.items():
            fixed = {mib: _fixed(model, mib * _MIB, steps) for mib in SWEEP_MIB}
            best_mib = _agreed_best(fixed)
            auto, chosen, search = _autotuned(model, steps)
            best_again = _fixed(model, best_mib * _MIB, steps)
            rep[name] = {"fixed": fixed, "auto": auto, "chosen_mib": chosen / _MIB, "search_steps": search,
                         "best_mib": best_mib, "best_again": best_again}
        out.append(rep)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--np", type=int, default=2)
    args = ap.parse_args()
    reps = run_workers(_bench, args.np, args=(args.reps, args.steps), timeout_seconds=3600)[0]
    ratios: dict[str, list[float]] = {}
    sweep_min: dict[str, list[float]] = {}
    for i, rep in enumerate(reps):
        for name, r in rep.items():
            ratio = r["auto"] / r["best_again"]
            ratios.setdefault(name, []).append(ratio)
            sweep_min.setdefault(name, []).append(r["auto"] / min(r["fixed"].values()))
            fixed = " ".join(f"{m}MiB={t * 1e3:.1f}ms" for m, t in r["fixed"].items())
            print(f"SAMPLE rep={i} {name} {fixed} autotuned={r['auto'] * 1e3:.1f}ms "
                  f"(chose {r['chosen_mib']:g} MiB after {r['search_steps']} steps) "
                  f"best_fixed={r['best_mib']}MiB re-measured={r['best_again'] * 1e3:.1f}ms "
                  f"ratio={ratio:.3f}")
    for name, rs in sweep_min.items():
        print(f"autotuned / fastest sweep time ({name}; biased low by the min over {len(SWEEP_MIB)} noisy "
              f"runs): median {statistics.median(rs):.3f}")
    print(f"load average: {os.getloadavg()[0]:.2f}")
    for name, rs in ratios.items():
        print(f"RATIO autotune_vs_best_fixed_{name}={statistics.median(rs):.3f}")
    print(f"RATIO autotune_vs_best_fixed={max(statistics.median(rs) for rs in ratios.values()):.3f}")

if __name__ == "__main__":
    main()

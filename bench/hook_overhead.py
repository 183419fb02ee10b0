"""Cost of the fused reducer's per-parameter gradient hook, in a world of one process.

Run: ``.venv/bin/python bench/hook_overhead.py [--layers 30] [--steps 200]``

Times forward+backward of an MLP with ``2 * layers`` parameter tensors without a reducer, then
with :class:`~hvd_trainer.comm.GradientReducer` attached (hooks, copy into buckets, one allreduce
per bucket over a world of one), alternating, one thread. Prints the per-parameter cost in
microseconds and ``RATIO reducer_vs_plain_step=<x>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import hvd_trainer as hvd
from hvd_trainer.comm import GradientReducer


def _step_ms(model: torch.nn.Module, x: torch.Tensor, steps: int, reducer: GradientReducer | None) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        if reducer is not None:
            reducer.wait()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = hvd.init()
    layers = [m for _ in range(args.layers) for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(32, 64)
    n_params = sum(1 for _ in model.parameters())
    plain, fused = [], []
    for _ in range(args.repeats):
        plain.append(_step_ms(model, x, args.steps, None))
        reducer = GradientReducer(model.named_parameters(), world=world)
        _step_ms(model, x, 10, reducer)  # warm-up (first-time cross-rank checks)
        fused.append(_step_ms(model, x, args.steps, reducer))
        reducer.remove()
    p, f = statistics.median(plain), statistics.median(fused)
    print(f"params={n_params} buckets={len(reducer.bucket_sizes_bytes)} plain={p:.3f} ms/step "
          f"reducer={f:.3f} ms/step hook_cost_per_param={(f - p) / n_params * 1e3:.1f} us "
          f"(load average {os.getloadavg()[0]:.2f})")
    print(f"RATIO reducer_vs_plain_step={f / p:.3f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()

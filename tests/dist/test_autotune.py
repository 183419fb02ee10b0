"""Autotune on 2 gloo ranks: every rank switches layout at the same step and ends on the same
layout, rank 0 logs every sample, and the weights equal a fixed layout's up to summation order."""

from __future__ import annotations

import csv
import statistics

import pytest
import torch

from tests.multiproc import run_workers

MIB = 1024 * 1024


def _train(log_file: str | None, steps: int) -> dict:
    import hvd_trainer as hvd
    from hvd_trainer.comm import AutotuneConfig, FusionConfig

    torch.manual_seed(0)
    # ~3.2 MB of float32 gradients in 6 tensors: 1, 2 and 4 MiB thresholds give different layouts
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 512),
                                torch.nn.Tanh(), torch.nn.Linear(512, 10))
    tune = None
    if log_file is not None:
        tune = AutotuneConfig(warmup_samples=1, steps_per_sample=2, warmup_steps_per_sample=1,
                              log_file=log_file, rounds=2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   fusion_config=FusionConfig(autotune=tune))
    layouts = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + hvd.rank())
        x, y = torch.randn(16, 256, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        layouts.append(tuple(opt._reducer.bucket_sizes_bytes))
    tuner = opt._reducer.autotuner
    return {
        "weights": [p.detach().tolist() for p in model.parameters()],
        "layouts": layouts,
        "done": None if tuner is None else tuner.done,
        "n_candidates": None if tuner is None else len(tuner.candidates),
        "best": None if tuner is None else [tuner.best.fusion_threshold_bytes, tuner.best.first_bucket_bytes],
        "n_samples": None if tuner is None else sum(map(len, tuner.samples.values())),
    }


@pytest.mark.timeout(240)
def test_autotune_switches_in_step_and_matches_a_fixed_layout(tmp_path) -> None:
    log = str(tmp_path / "autotune.csv")
    steps = 60
    tuned = run_workers(_train, 2, args=(log, steps), timeout_seconds=200)
    fixed = run_workers(_train, 2, args=(None, steps), timeout_seconds=200)
    assert tuned[0]["layouts"] == tuned[1]["layouts"]          # same layout at every step on every rank
    assert tuned[0]["done"] and tuned[0]["n_candidates"] >= 3
    seen = list(dict.fromkeys(tuned[0]["layouts"]))
    assert len(seen) >= 3, seen                                  # it really tried other layouts
    assert len(set(fixed[0]["layouts"])) == 1
    for a, b in zip(tuned[0]["weights"], fixed[0]["weights"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)  # up to order
    assert tuned[0]["weights"] == tuned[1]["weights"]
    rows = list(csv.DictReader(open(log)))
    statuses = [r["status"] for r in rows]
    # one row per sample: the warm-up one, then every agreed sample, numbered 1, 2, ...
    assert statuses == ["warmup"] + ["sample"] * tuned[0]["n_samples"], statuses
    assert [int(r["sample"]) for r in rows] == list(range(1, len(rows) + 1))
    first_round = [r for r in rows if r["status"] == "sample" and r["round"] == "0"]
    assert len(first_round) == tuned[0]["n_candidates"]          # round 1 measured every candidate
    assert any(r["round"] == "1" for r in rows)                  # round 2 re-measured the faster half
    scores: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r["status"] == "sample":
            scores.setdefault((r["fusion_threshold_bytes"], r["first_bucket_bytes"]), []).append(
                float(r["step_seconds"]))
    second = {k: v for k, v in scores.items() if len(v) == 2}
    key = tuple(map(str, tuned[0]["best"]))
    assert tuned[1]["best"] == tuned[0]["best"]
    assert key in second and statistics.median(second[key]) == min(statistics.median(v) for v in second.values())
    best_buckets = {int(r["num_buckets"]) for r in rows if (r["fusion_threshold_bytes"], r["first_bucket_bytes"]) == key}
    assert best_buckets == {len(tuned[0]["layouts"][-1])}   # it stayed on the best layout

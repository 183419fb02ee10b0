"""The lab's time-to-quality arithmetic (bench/lab/ttq.py) on records written by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.lab import ttq


def _curve(points: list[tuple[int, float, float]]) -> list[dict]:
    return [{"step": s, "seconds": t, "val_loss": v, "comm_bytes_sent": 0} for s, t, v in points]


def _records(seed: int, target: float, given: bool) -> list[dict]:
    ranks = range(2)
    trained = [{"seed": seed, "ttq": ttq.TARGET, "val_loss": target, "seconds": 900.0 + r, "steps": 96}
               for r in ranks]
    recs = [{"seed": seed, "ttq": ttq.TARGET, "val_loss": target, "given": True}] if given else trained
    recs += [{"seed": seed, "ttq": ttq.DDP_STEP, "seconds": 6.0 + r, "steps": 10}  # 0.7 s/step
             for r in ranks]
    fast = _curve([(32, 10.0, 2.0), (64, 20.0, target), (96, 30.0, target - 0.1)])
    slow = _curve([(32, 30.0, 2.5), (64, 60.0, 2.2), (96, 90.0, 2.1), (128, 120.0, target + 0.01)])
    recs += [{"seed": seed, "ttq": "localsgd:32", "curve": fast} for _ in ranks]
    recs += [{"seed": seed, "ttq": "powersgd", "curve": slow} for _ in ranks]  # never reaches it
    return recs


def test_speedups_use_ddps_measured_time_or_its_step_time_for_a_given_target(capsys) -> None:
    records = _records(1, 1.6, given=False) + _records(2, 1.5, given=True)
    got = ttq.report("lab_20mbit", records, steps=96, eval_every=32)
    # seed 1: DDP trained here, 901 s (slowest rank); seed 2: 96 steps x 0.7 s = 67.2 s
    assert got["localsgd:32"] == {1: pytest.approx(901.0 / 20.0), 2: pytest.approx(67.2 / 20.0)}
    assert got["powersgd"] == {1: 0.0, 2: 0.0}  # never reached: counted as no speed-up at all
    out = capsys.readouterr().out
    assert "TTQ lab_20mbit seed=2 target_val_loss=1.5000 (DDP fp32 after 96 steps) ddp_step_s=0.7000 " \
           "ddp_time_to_target_s=67.2 (= 96 x ddp_step_s)" in out
    assert "TTQ lab_20mbit seed=1 powersgd steps_to_target=never time_to_target_s=never " \
           "val_loss_at_96=2.1000" in out
    assert "RATIO lab_20mbit_ttq_localsgd32_speedup_vs_ddp median=24.205 spread=3.360-45.050 seeds=2" in out
    assert "RATIO lab_20mbit_ttq_localsgd32_val_at_96_vs_target median=0.935 spread=0.933-0.938" in out
    assert "RATIO lab_20mbit_ttq_powersgd_speedup_vs_ddp median=0.000" in out


def test_equal_tokens_step_is_the_first_validation_at_or_after_the_steps() -> None:
    assert ttq.equal_tokens_step(1500, 32) == 1504
    assert ttq.equal_tokens_step(1472, 32) == 1472


def test_main_prints_the_report_from_a_records_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "r.jsonl"
    recs = [{**r, "rate": "20mbit", "ttq_steps": 96, "ttq_eval_every": 32} for r in _records(3, 1.6, True)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + json.dumps({"rate": "20mbit"}) + "\n")
    ttq.main([str(path)])
    assert "RATIO lab_20mbit_ttq_localsgd32_speedup_vs_ddp median=3.360" in capsys.readouterr().out

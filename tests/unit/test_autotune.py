"""The autotune search (single process): the order candidates are tried in, warm-up samples,
the choice, the CSV log, and the HOROVOD_AUTOTUNE* variables."""

from __future__ import annotations

import csv

import pytest

from hvd_trainer.comm.reduce.autotune import (
    LOG_COLUMNS,
    AutotuneConfig,
    Autotuner,
    Candidate,
    candidate_thresholds,
)
from hvd_trainer.strategy import HorovodStrategy, StrategyConfigError

MIB = 1024 * 1024


def _feed(tuner: Autotuner, seconds: float, steps: int) -> list:
    """Record ``steps`` steps of ``seconds``; advance with the local sample when one completes."""
    moves = []
    for _ in range(steps):
        if tuner.record(seconds):
            moves.append(tuner.advance(tuner.local_sample()))
    return moves


def test_search_tries_each_candidate_once_after_warmup_and_keeps_the_fastest(tmp_path) -> None:
    cands = [Candidate(16 * MIB, MIB, 3), Candidate(MIB, MIB, 9), Candidate(64 * MIB, 64 * MIB, 1)]
    log = tmp_path / "autotune.csv"
    cfg = AutotuneConfig(warmup_samples=1, steps_per_sample=3, warmup_steps_per_sample=1, log_file=str(log),
                         rounds=1)
    tuner = Autotuner(cands, cfg, rank=0)
    assert tuner.best == cands[0] and not tuner.done
    assert _feed(tuner, 9.0, 4) == [None]            # 1 untimed + 3 timed: the warm-up sample, discarded
    assert _feed(tuner, 0.30, 4) == [cands[1]]       # configured layout measured -> try the next
    assert _feed(tuner, 0.20, 4) == [cands[2]]
    assert _feed(tuner, 0.25, 4) == [cands[1]]       # all measured: back to the fastest
    assert tuner.done and tuner.best == cands[1]
    assert _feed(tuner, 0.1, 20) == []               # nothing more once done
    rows = list(csv.reader(log.open()))
    assert tuple(rows[0]) == LOG_COLUMNS
    # one row per sample, numbered 1..4, and nothing else: the choice is not a sample
    assert [(r[0], r[-1]) for r in rows[1:]] == [("1", "warmup"), ("2", "sample"), ("3", "sample"),
                                                 ("4", "sample")]
    assert [r[2:6] for r in rows[2:]] == [[str(16 * MIB), str(MIB), "3", "0.300000"],
                                          [str(MIB), str(MIB), "9", "0.200000"],
                                          [str(64 * MIB), str(64 * MIB), "1", "0.250000"]]
    assert tuner.summary() == ("autotune: chose fusion threshold 1 MiB, first bucket 1 MiB (9 buckets): "
                               "median step 0.2000 s, the fastest of 3 layouts over 1 round, 3 samples")


def test_successive_halving_remeasures_the_faster_half() -> None:
    cands = [Candidate(i, i, i) for i in range(1, 5)]
    tuner = Autotuner(cands, AutotuneConfig(warmup_samples=0, steps_per_sample=1, warmup_steps_per_sample=0,
                                            rounds=3))
    moves = []
    for t in (0.4, 0.1, 0.3, 0.2,   # round 1: every candidate; the faster half is cands[1], cands[3]
              0.5, 0.15):           # round 2: cands[1] scores median(0.1, 0.5)=0.3, cands[3] 0.175
        assert tuner.record(t)
        moves.append(tuner.advance(t))
    assert moves == [cands[1], cands[2], cands[3], cands[1], cands[3], cands[3]]
    assert tuner.done and tuner.round == 2 and tuner.best == cands[3]
    assert tuner.score(3) == pytest.approx(0.175)
    assert tuner.summary().endswith("median step 0.1750 s, the fastest of 4 layouts over 2 rounds, 6 samples")


def test_median_of_a_sample_and_max_samples() -> None:
    cands = [Candidate(i * MIB, MIB, i) for i in range(1, 6)]
    tuner = Autotuner(cands, AutotuneConfig(warmup_samples=0, steps_per_sample=3, warmup_steps_per_sample=0,
                                            max_samples=2))
    assert len(tuner.candidates) == 2
    for t in (0.5, 0.1, 9.0):
        done = tuner.record(t)
    assert done and tuner.local_sample() == 0.5
    tuner.advance(0.5)
    _feed(tuner, 0.6, 3)
    assert tuner.done and tuner.best == cands[0]


def test_only_rank_zero_writes_the_log(tmp_path) -> None:
    log = tmp_path / "a.csv"
    Autotuner([Candidate(1, 1, 1), Candidate(2, 2, 2)], AutotuneConfig(log_file=str(log)), rank=1)
    assert not log.exists()


def test_candidates_start_with_the_configured_layout() -> None:
    pairs = candidate_thresholds((16 * MIB, MIB))
    assert pairs[0] == (16 * MIB, MIB) and len(pairs) == len(set(pairs))
    assert (256 * MIB, 256 * MIB) in pairs and (MIB, MIB) in pairs


def test_environment_variables() -> None:
    assert AutotuneConfig.from_env({}) is None
    assert AutotuneConfig.from_env({"HOROVOD_AUTOTUNE": "0"}) is None
    cfg = AutotuneConfig.from_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "t.csv",
                                   "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
                                   "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4",
                                   "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "6"})
    assert cfg == AutotuneConfig(warmup_samples=1, steps_per_sample=4, max_samples=6, log_file="t.csv")
    with pytest.raises(ValueError, match="HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE='x' is not an integer"):
        AutotuneConfig.from_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "x"})
    with pytest.raises(ValueError, match=">= 1"):
        AutotuneConfig(steps_per_sample=0)


def test_strategy_option(monkeypatch) -> None:
    monkeypatch.delenv("HOROVOD_AUTOTUNE", raising=False)
    assert HorovodStrategy()._fusion.autotune is None
    assert HorovodStrategy(autotune=True)._fusion.autotune == AutotuneConfig()
    monkeypatch.setenv("HOROVOD_AUTOTUNE", "1")
    assert HorovodStrategy()._fusion.autotune == AutotuneConfig()      # hvdrun --autotune
    assert HorovodStrategy(autotune=False)._fusion.autotune is None
    with pytest.raises(StrategyConfigError, match="autotune="):
        HorovodStrategy(autotune="yes")


def test_true_takes_the_hvdrun_settings_and_fusion_config_accepts_it(monkeypatch, tmp_path) -> None:
    from hvd_trainer.comm import FusionConfig

    log = str(tmp_path / "at.csv")
    monkeypatch.delenv("HOROVOD_AUTOTUNE", raising=False)
    monkeypatch.setenv("HOROVOD_AUTOTUNE_LOG", log)               # hvdrun --autotune-log-file
    monkeypatch.setenv("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "4")
    want = AutotuneConfig(steps_per_sample=4, log_file=log)
    assert HorovodStrategy(autotune=True)._fusion.autotune == want
    assert FusionConfig(autotune=True).autotune == want
    assert FusionConfig(autotune=False).autotune is None
    assert FusionConfig().autotune is None                           # HOROVOD_AUTOTUNE unset
    with pytest.raises(TypeError, match="autotune="):
        FusionConfig(autotune="yes")


def test_a_single_layout_still_writes_the_log(tmp_path) -> None:
    log = tmp_path / "one.csv"
    tuner = Autotuner([Candidate(MIB, MIB, 1)], AutotuneConfig(log_file=str(log)), rank=0)
    assert tuner.done
    rows = list(csv.reader(log.open()))
    assert tuple(rows[0]) == LOG_COLUMNS and rows[1][-1] == "only_layout" and len(rows) == 2
    assert tuner.summary() == ("autotune: fusion threshold 1 MiB, first bucket 1 MiB (1 bucket), the only "
                               "layout of these gradients: nothing to search")

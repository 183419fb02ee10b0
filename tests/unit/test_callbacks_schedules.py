"""Closed-form tables for hvd_trainer.callbacks (warmup, schedule, single-rank averaging)."""

from __future__ import annotations

import math

import pytest
import torch

from hvd_trainer.callbacks import LRSchedule, LRWarmup, ScheduleError, average_metrics, fractional_epoch
from hvd_trainer.comm.world.world import World


def test_warmup_table_goyal():
    w = LRWarmup(initial_lr=0.8, warmup_epochs=2, size=4)
    # lr = 0.8/4 * (t * 3/2 + 1): 0.2 at t=0, 0.5 at t=1, 0.8 from t=2 on
    for t, lr in [(0, 0.2), (0.5, 0.35), (1, 0.5), (1.75, 0.725), (2, 0.8), (7.3, 0.8)]:
        assert w.lr_at(t) == pytest.approx(lr, rel=1e-12)
    assert w.in_warmup(1.99) and not w.in_warmup(2.0)
    assert LRWarmup(initial_lr=0.1, warmup_epochs=3, size=1).lr_at(0.4) == pytest.approx(0.1)


def test_schedule_float_compounds_from_start_epoch():
    # Horovod's table: lr = initial_lr * m ** (epoch - start_epoch), factor 1 at start_epoch
    s = LRSchedule(initial_lr=1.0, multiplier=0.1, start_epoch=2, end_epoch=4)
    assert [s.lr_at(e) for e in range(6)] == [None, None, pytest.approx(1.0), pytest.approx(0.1), None, None]
    assert s.lr_at(2, batch=1) is None  # staircase (the default): first batch only
    assert s.staircase
    assert LRSchedule(initial_lr=0.5, multiplier=0.5).lr_at(0) == pytest.approx(0.5)


def test_schedule_float_without_staircase_decays_per_batch():
    s = LRSchedule(initial_lr=1.0, multiplier=0.25, start_epoch=1, staircase=False)
    assert s.lr_at(0, batch=3, steps_per_epoch=4) is None
    assert s.lr_at(1, batch=0, steps_per_epoch=4) == pytest.approx(1.0)
    assert s.lr_at(1, batch=2, steps_per_epoch=4) == pytest.approx(0.5)  # 0.25 ** 0.5
    assert s.lr_at(3, batch=0, steps_per_epoch=4) == pytest.approx(0.0625)


def test_schedule_function_per_batch():
    s = LRSchedule(initial_lr=0.3, multiplier=lambda e: 1 / (1 + e), staircase=False)
    assert s.lr_at(1, batch=2, steps_per_epoch=4) == pytest.approx(0.3 / 2.5)
    assert fractional_epoch(3, 1, 4) == 3.25


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"initial_lr": 0.1, "multiplier": "x"}, "multiplier='x'"),
        ({"initial_lr": 0.1, "multiplier": 0.5, "start_epoch": 3, "end_epoch": 3}, "end_epoch=3"),
        ({"initial_lr": -1.0, "multiplier": 0.5}, "initial_lr=-1.0"),
    ],
)
def test_schedule_errors_echo_value(kwargs, fragment):
    with pytest.raises(ScheduleError, match=fragment.replace("(", r"\(")):
        LRSchedule(**kwargs)


def test_warmup_and_steps_errors():
    with pytest.raises(ScheduleError, match="warmup_epochs=0"):
        LRWarmup(initial_lr=0.1, warmup_epochs=0, size=2)
    with pytest.raises(ScheduleError, match="HINT"):
        fractional_epoch(0, 0, None)


def test_average_metrics_world_of_one_keeps_numbers_only():
    world = World(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                  device=torch.device("cpu"), backend="gloo")
    out = average_metrics({"loss": 0.5, "acc": torch.tensor(2.0).numpy(), "name": "x", "flag": True},
                          world=world)
    assert out == {"acc": 2.0, "loss": 0.5}
    assert all(isinstance(v, float) and not math.isnan(v) for v in out.values())

"""bench/slow_link_training.py: mode parsing, and one local (communication-free) CNN run whose
record carries what the lab reads."""

from __future__ import annotations

import pytest

from bench.slow_link_training import SlowLinkArgs, parse_mode, run_mode
from hvd_trainer.comm.ops.compression import DEFAULT_POWERSGD_RANK


def test_parse_mode_defaults_and_errors() -> None:
    assert parse_mode("sync") == ("sync", 0)
    assert parse_mode("powersgd") == ("powersgd", DEFAULT_POWERSGD_RANK)  # the library's default
    assert parse_mode("powersgd:2") == ("powersgd", 2) and parse_mode("ddp_powersgd") == ("ddp_powersgd", 4)
    assert parse_mode("localsgd") == ("localsgd", 32) and parse_mode("localsgd:8") == ("localsgd", 8)
    for bad in ("fp8", "int8:2", "localsgd:0", "localsgd:x"):
        with pytest.raises(ValueError, match="mode"):
            parse_mode(bad)


def test_local_cnn_run_prints_a_lab_record(capsys: pytest.CaptureFixture[str]) -> None:
    rec = run_mode(SlowLinkArgs(mode="local", model="cnn", steps=2, warmup=1, batch=8, val_batches=2))
    assert rec["steps"] == 2 and rec["world"] == 1 and rec["comm_bytes_sent"] == 0
    assert 0 < rec["val_loss"] < 10 and rec["tokens_per_s"] > 0
    out = capsys.readouterr().out
    assert out.count("LAB {") == 1 and "RESULT mode=local model=cnn" in out


def test_curve_and_stop_below() -> None:
    assert parse_mode("localsgd_int8:16") == ("localsgd_int8", 16)
    rec = run_mode(SlowLinkArgs(mode="local", model="cnn", steps=12, warmup=0, batch=8, val_batches=2,
                                eval_every=3))
    assert [p["step"] for p in rec["curve"]] == [3, 6, 9, 12]
    seconds = [p["seconds"] for p in rec["curve"]]
    assert seconds == sorted(seconds) and seconds[-1] <= rec["seconds"] + 1e-6
    # a target every validation meets: the run stops at the first one at or after min_steps
    stopped = run_mode(SlowLinkArgs(mode="local", model="cnn", steps=12, warmup=0, batch=8, val_batches=2,
                                    eval_every=3, stop_below=100.0, min_steps=5))
    assert stopped["steps"] == 6 and [p["step"] for p in stopped["curve"]] == [3, 6]


def test_schedule_steps_give_the_gpt_recipes_adamw_and_schedule() -> None:
    from torch import nn

    from bench.slow_link_training import _inner

    net = nn.Linear(4, 4)
    inner, schedule = _inner(net, SlowLinkArgs(schedule_steps=40))
    matrices, vectors = inner.param_groups
    assert (matrices["weight_decay"], vectors["weight_decay"], matrices["betas"]) == (0.1, 0.0, (0.9, 0.99))
    assert matrices["lr"] == pytest.approx(3e-3 / 20)  # the first of 20 warm-up steps
    lrs = []
    for _ in range(60):
        inner.step()
        schedule.step()
        lrs.append(matrices["lr"])
    assert lrs[18] == pytest.approx(3e-3) and lrs[39:] == pytest.approx([3e-4] * 21)  # decayed by step 40
    assert all(a >= b for a, b in zip(lrs[19:], lrs[20:], strict=False))
    inner, schedule = _inner(net, SlowLinkArgs())  # the default: constant lr, no weight decay
    for _ in range(3):
        inner.step()
        schedule.step()
    assert [(g["lr"], g["weight_decay"]) for g in inner.param_groups] == [(3e-3, 0.0)]

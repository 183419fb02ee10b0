"""The lab's side-by-side lines (bench/lab/workloads.py): the per-round ratio and the overhead
beyond compute, on records written by hand, and the ABBA order of the modes."""

from __future__ import annotations

from bench.lab import workloads
from bench.lab.records import summarise


def _rec(mode: str, round_: int, step_s: float, rank: int) -> dict:
    return {"workload": "loop", "mode": mode, "round": round_, "steps": 10, "seconds": 10 * step_s,
            "host": f"h{rank}", "rank": rank, "tx": 0, "rx": 0, "batch": 32, "world": 2}


def test_modes_alternate_their_order_between_rounds() -> None:
    assert [workloads._in_turn(("hvd", "ddp"), r) for r in range(4)] == [
        ["hvd", "ddp"], ["ddp", "hvd"], ["hvd", "ddp"], ["ddp", "hvd"]]


def test_per_round_ratio_and_overhead_use_each_rounds_own_times(capsys) -> None:
    # Per round (slowest rank): hvd 0.40 / 0.33 / 0.36 s, ddp 0.44 / 0.30 / 0.36 s, local 0.30 s.
    times = {"hvd": (0.40, 0.33, 0.36), "ddp": (0.44, 0.30, 0.36), "local": (0.30, 0.30, 0.30)}
    recs = [_rec(mode, r, t - 0.01 * rank, rank) for mode, ts in times.items() for r, t in enumerate(ts)
            for rank in range(2)]
    s = summarise(recs)
    got = {m: s[("loop", m)] for m in ("hvd", "ddp")}
    workloads._versus("lab_1gbit", "loop", got, [("hvd", "ddp"), ("hvd_bf16", "ddp"), ("ddp", "hvd")], recs)
    out = capsys.readouterr().out.splitlines()
    # ratios ddp/hvd per round: 1.100, 0.909, 1.000; the bf16 pair did not run: no line; the
    # reversed pair gives its ratios but no second OVERHEAD line per mode
    assert out == [
        "RATIO lab_1gbit_loop_hvd_vs_ddp=1.000",
        "RATIO lab_1gbit_loop_hvd_vs_ddp_per_round median=1.000 spread=0.909-1.100 rounds=3",
        "OVERHEAD lab_1gbit loop hvd beyond_compute_s median=0.0600 spread=0.0300-0.1000 rounds=3",
        "OVERHEAD lab_1gbit loop ddp beyond_compute_s median=0.0600 spread=0.0000-0.1400 rounds=3",
        "RATIO lab_1gbit_loop_ddp_vs_hvd=1.000",
        "RATIO lab_1gbit_loop_ddp_vs_hvd_per_round median=1.000 spread=0.909-1.100 rounds=3",
    ]

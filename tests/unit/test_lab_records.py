"""bench/lab arithmetic: rate strings, combining ranks' windows, wire efficiency."""

from __future__ import annotations

import pytest

from bench.lab.net import parse_rate
from bench.lab.records import parse, summarise, wire_efficiency


def test_parse_rate() -> None:
    assert parse_rate("20mbit") == 20e6
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("2.5Gbit") == 2.5e9
    assert parse_rate("unshaped") is None
    with pytest.raises(ValueError, match="expected e.g. 20mbit"):
        parse_rate("20MB/s")


def _rec(host: str, rank: int, round_: int, seconds: float, tx: int, rx: int) -> dict:
    return {"workload": "loop", "mode": "hvd", "round": round_, "steps": 4, "batch": 8, "world": 4,
            "host": host, "rank": rank, "seconds": seconds, "tx": tx, "rx": rx}


def test_summarise_slowest_rank_busiest_port_median_round() -> None:
    recs = [
        _rec("h1", 0, 0, 2.0, 100, 80), _rec("h1", 1, 0, 2.2, 100, 80),   # same host, same counters
        _rec("h2", 2, 0, 2.1, 60, 120), _rec("h2", 3, 0, 2.0, 60, 120),
        _rec("h1", 0, 1, 4.0, 400, 0), _rec("h2", 2, 1, 4.0, 0, 0),
        _rec("h1", 0, 2, 1.0, 40, 0), _rec("h2", 2, 2, 1.0, 0, 0),
    ]
    (s,) = summarise(recs).values()
    # rounds: step 2.2/4, 4/4, 1/4 -> median 0.55; bytes 120/4, 400/4, 40/4 -> median 30
    assert s.rounds == 3
    assert s.step_s == pytest.approx(0.55)
    assert s.bytes_per_step == pytest.approx(30.0)
    # samples/s: 8 x 4 x 4 samples over 2.2, 4.0, 1.0 s -> median 128 / 2.2
    assert s.samples_per_s == pytest.approx(128 / 2.2)


def test_parse_reads_prefixed_lines() -> None:
    out = '[1]<stdout>:LAB {"a": 1}\nnoise\nLAB {"b": [2]}\n'
    assert parse([out]) == [{"a": 1}, {"b": [2]}]


def test_wire_efficiency() -> None:
    # comm-bound: 3 MB at 1 MB/s = 3 s of wire; a 4 s step reaches 0.75 of the limit
    assert wire_efficiency(4.0, 1.0, 3e6, 1e6) == pytest.approx(0.75)
    # compute-bound: the compute time is the limit
    assert wire_efficiency(2.5, 2.0, 1e6, 1e6) == pytest.approx(0.8)


def test_slow_link_time_to_target_and_bytes_per_token() -> None:
    from bench.lab.slow_link import _at_step, _per_token, _time_to

    curve = [{"step": 32, "seconds": 10.0, "val_loss": 3.0}, {"step": 64, "seconds": 19.0, "val_loss": 2.5},
             {"step": 96, "seconds": 30.0, "val_loss": 2.4}]
    assert _time_to(curve, 2.5) == 19.0 and _time_to(curve, 2.45) == 30.0 and _time_to(curve, 2.0) is None
    assert _at_step(curve, 64) == 2.5 and _at_step(curve, 65) is None
    recs = [{"steps": 10, "tokens_per_step": 100, "comm_bytes_sent": 4000, "tx": 5000, "rx": 4500},
            {"steps": 10, "tokens_per_step": 100, "comm_bytes_sent": 3000, "tx": 4000, "rx": 6000}]
    assert _per_token(recs) == (4.0, 6.0)  # the busiest rank / the busiest direction, per global token
    recs[0]["comm_bytes_sent"] = recs[1]["comm_bytes_sent"] = -1  # DDP: not counted by us
    assert _per_token(recs) == (-1.0, 6.0)

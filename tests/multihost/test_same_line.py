"""Same-line mode across two namespace hosts (2 x 2 processes): ``hvdrun -np 4 -H h1:2,h2:2 --port P``
run on each host; the torch API (ZeRO stage 2 included), Lightning ``fit`` and Keras ``fit`` give
the values of one process."""

from __future__ import annotations

import time

import pytest

from tests.multihost.helpers import explain, records, same_line
from tests.multihost.netns import cluster

pytestmark = pytest.mark.timeout(240)


def _check_weights(runs, tag_fields: int) -> None:
    out = "\n".join(r.output for r in runs)
    weights = {int(rec[0]): rec[-1] for rec in records(out, "WEIGHTS")}
    assert sorted(weights) == [0, 1, 2, 3], explain(runs)
    assert all(len(rec) == tag_fields + 1 for rec in records(out, "WEIGHTS"))
    assert all(weights[r] == weights[0] for r in weights), "ranks disagree on the weights"
    (ref,) = [rec[-1] for rec in records(out, "REFERENCE")]
    assert len(ref) == len(weights[0])
    assert max(abs(a - b) for a, b in zip(weights[0], ref, strict=True)) < 2e-5, (weights[0], ref)


def _run(script: str, timeout: float = 200.0):
    with cluster(2) as c:
        start = time.monotonic()
        runs = same_line(c, script, timeout=timeout)
        print(f"{script}: 2 hosts x 2 processes took {time.monotonic() - start:.1f} s")
        assert [r.returncode for r in runs] == [0, 0], explain(runs)
        assert c.pids() == {"h1": [], "h2": []}, "processes left behind"
        return runs


def test_torch_api_values_and_optimizer_match_one_process() -> None:
    runs = _run("torch_api.py")
    out = "\n".join(r.output for r in runs)
    got = {int(rank): (host, values) for rank, host, values in records(out, "ALLREDUCE")}
    assert sorted(got) == [0, 1, 2, 3], explain(runs)
    for rank, (host, values) in got.items():
        assert host == ("h1" if rank < 2 else "h2")
        assert values == {"sum": [6.0, 10.0, 14.0], "avg": [1.5, 2.5, 3.5], "max": [3.0, 4.0, 5.0],
                          "gathered": [0, 1, 2, 3], "bcast": [30.0],
                          "local": [rank % 2, 2, rank // 2, 2]}, (rank, values)
    _check_weights(runs, tag_fields=1)
    # ZeRO stage 2 with Adam across the hosts: every rank equal to one process's Adam
    zero = {int(rec[0]): rec[-1] for rec in records(out, "ZERO")}
    (ref,) = [rec[-1] for rec in records(out, "REFERENCE_ADAM")]
    assert sorted(zero) == [0, 1, 2, 3] and all(zero[r] == zero[0] for r in zero), explain(runs)
    assert max(abs(a - b) for a, b in zip(zero[0], ref, strict=True)) < 2e-5, (zero[0], ref)


def test_lightning_fit_matches_one_process() -> None:
    runs = _run("lightning_fit.py")
    _check_weights(runs, tag_fields=2)
    out = "\n".join(r.output for r in runs)
    assert {rec[1] for rec in records(out, "WEIGHTS")} == {"4"}


def test_keras_fit_matches_one_process() -> None:
    _check_weights(_run("keras_fit.py", timeout=220.0), tag_fields=1)

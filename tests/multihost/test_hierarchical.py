"""Hierarchical allreduce on 2 namespace hosts x 2 processes: values equal the flat reducer's
and the closed form; on one host it is never used."""

from __future__ import annotations

import pytest

from tests.multihost.helpers import explain, records, same_line
from tests.multihost.netns import cluster

pytestmark = pytest.mark.timeout(240)


def test_hierarchical_equals_flat_across_two_hosts() -> None:
    with cluster(2) as c:
        runs = same_line(c, "hierarchical.py", timeout=200)
        assert [r.returncode for r in runs] == [0, 0], explain(runs)
    got = {int(rank): rec for rank, rec in records("\n".join(r.output for r in runs), "HIER")}
    assert sorted(got) == [0, 1, 2, 3], explain(runs)
    for rank, rec in got.items():
        assert rec["used"] and not rec["flat_used"], rank
        assert (rec["hosts"], rec["local_size"]) == (2, 2)
        assert rec["sum7"] == rec["expected7"]
        for h, f in zip(rec["hier"], rec["flat"], strict=True):
            assert h == pytest.approx(f, abs=1e-6), (rank, h, f)
        assert rec["hier"] == got[0]["hier"], "ranks disagree"
    # closed form: d(sum of outputs)/d(bias of the last layer) = batch size 2 on every rank
    assert got[0]["hier"][-1] == [2.0]

"""A correct job ends cleanly over a slow link: a rank that finished its part of the last
collective and exited is not a failed rank.

Two namespace hosts, 1 process each, the link shaped to 2 Mbit/s each way (``tc`` TBF). The job's
last collective is a 512 KiB broadcast from rank 0: rank 0's part ends once its bytes are in the
kernel's socket buffers, so it exits about two seconds before rank 1 has received them. Rank 1,
still waiting, looks for missing ranks after one second; it must find that rank 0 entered the
collective before it exited (its shutdown record) and keep receiving, not raise
``RankFailedError`` (and leave rank 0's hvdrun in torchrun's 300 s exit barrier).
"""

from __future__ import annotations

import pytest

from bench.lab.net import shape
from tests.multihost.helpers import explain, records, same_line
from tests.multihost.netns import cluster

pytestmark = pytest.mark.timeout(120)

NUMEL = 128 * 1024


def test_the_last_rank_still_receiving_does_not_blame_the_one_that_finished() -> None:
    with cluster(2) as c:
        shape(c, "2mbit")
        runs = same_line(c, "last_broadcast.py", str(NUMEL), np_per_host=1, timeout=60)
        assert [r.returncode for r in runs] == [0, 0], explain(runs)
        done = {int(rec[0]): rec for rec in records("\n".join(r.output for r in runs), "DONE")}
        assert sorted(done) == [0, 1], explain(runs)
        for rank in (0, 1):
            assert done[rank][-1] == [NUMEL - 1.0, NUMEL * (NUMEL - 1) / 2], done[rank]
        # the case under test happened: rank 0 was gone for longer than the one second after
        # which a waiting rank looks for missing peers (measured: 2.2 s)
        lag = float(done[1][2]) - float(done[0][2])
        assert lag > 1.2, f"rank 1 finished only {lag:.2f} s after rank 0\n{explain(runs)}"
        assert c.pids() == {"h1": [], "h2": []}, "processes left behind"


def test_a_finished_host_does_not_wait_for_the_agent_of_a_failed_one() -> None:
    """Rank 0 (h1) finishes; rank 1 (h2) then exits 3. h1's hvdrun must end within seconds
    of h2's, naming h2, not after torchrun's 300 s exit barrier."""
    with cluster(2) as c:
        runs = same_line(c, "fail_after_peer.py", np_per_host=1, timeout=90)
        h1, h2 = runs
        assert h2.returncode != 0 and h1.returncode == 0, explain(runs)
        assert "hvdrun: the workers on host h2 failed" in h1.output, explain(runs)
        assert abs(h1.seconds - h2.seconds) < 10.0, explain(runs)
        assert c.pids() == {"h1": [], "h2": []}, "processes left behind"

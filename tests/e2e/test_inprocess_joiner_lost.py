"""In-process recovery when the restarted worker is lost again while it joins.

The survivor has let the restarted rank in (``HostsUpdatedInterrupt`` at its commit, a world of 2)
and is syncing the state to it when the joiner is SIGKILLed: the sync fails with a peer's failure.
The survivor re-forms the world again (alone), goes on, and lets the third start of the rank in;
the job ends normally with both ranks at the last step holding equal weights.
"""

from __future__ import annotations

import re

from tests.e2e.hvdrun_helpers import SCRIPTS, hvdrun

WORKER = str(SCRIPTS / "joiner_dies_worker.py")


def test_a_joiner_lost_during_its_join_does_not_end_the_job() -> None:
    res = hvdrun(["-np", "2", "--min-np", "1", "--max-np", "2", "--recovery", "in-process", "python", WORKER],
                 timeout=180)
    assert res.returncode == 0, res.explain()
    assert "JOINER_DIES" in res.output and "re-forming again" in res.output, res.explain()
    done = re.findall(r"DONE slot=(\d) respawn=(\d) step=(\d+) size=(\d) sum=(\S+)", res.output)
    assert sorted((d[0], d[1], d[3]) for d in done) == [("0", "0", "2"), ("1", "2", "2")], res.explain()
    assert done[0][2] == done[1][2] and int(done[0][2]) >= 60, res.explain()
    assert done[0][4] == done[1][4], res.explain()  # the same weights on both ranks

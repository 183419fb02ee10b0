"""Faults across hosts in the one-command ssh launch: hvdrun runs once, on h1, and starts h2's
agent through a real sshd in h2 (keys made by the test). The job's secret is made by hvdrun and
carried by the ssh session (never on a command line).

* h2 dies (every process on it, its sshd too, SIGKILLed): h1's ranks raise RankFailedError naming
  h2's ranks and hvdrun exits non-zero within 10 s;
* the link to h2 is cut: both sides stop within 30 s naming the other host, and no process of
  the job is left on either host.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.multihost.faults_helpers import SCRIPTS, Job, start_job
from tests.multihost.helpers import HVDRUN
from tests.multihost.netns import Cluster, cluster
from tests.multihost.sshd import hvdrun_ssh_args, make_keys, ssh_skip_reason, start_sshd

pytestmark = pytest.mark.skipif(ssh_skip_reason() is not None, reason=str(ssh_skip_reason()))


def _ssh_job(tmp_path: Path, c: Cluster) -> tuple[Job, set[int]]:
    keys = make_keys(tmp_path / "keys")
    h1, h2 = c.hosts
    start_sshd(h2, keys)
    sshd = set(h2.pids())
    argv = [*HVDRUN, "-np", "4", "-H", "h1:2,h2:2", *hvdrun_ssh_args(keys), "python",
            str(SCRIPTS / "fault_loop.py")]
    job = start_job(c, [h1], argv)
    assert job.wait_for("h1", "step 40 on h2", timeout=150), job.tail()
    assert job.wait_for("h1", "step 40 on h1", timeout=30), job.tail()
    return job, sshd


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _left(c: Cluster, keep: set[int], grace_seconds: float = 10.0) -> dict[str, list[str]]:
    """The job's processes still on each host: not the test's sshd (``keep``), nor the sshd
    session process of a cut connection (it waits for TCP to give up on h1; not the job's)."""
    deadline = time.monotonic() + grace_seconds
    while True:
        left = {name: [f"{p} {_cmdline(p)}" for p in pids if p not in keep
                       and not _cmdline(p).startswith("sshd:")] for name, pids in c.pids().items()}
        if not any(left.values()) or time.monotonic() > deadline:
            return {k: v for k, v in left.items() if v}
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_ssh_launch_a_killed_host_stops_the_job_within_10_s(tmp_path: Path) -> None:
    with cluster(2) as c:
        job, _ = _ssh_job(tmp_path, c)
        killed_at = time.monotonic()
        c.kill_host(c.host("h2"))
        waited = job.exit_times(killed_at, timeout=30)["h1"]
        print(f"\nFAULT-TIME ssh host kill: hvdrun exited {waited} s after h2 was killed "
              f"(exit code {job.procs['h1'].returncode})")
        text = job.text("h1")
        assert waited is not None and waited < 10.0, job.tail()
        assert job.procs["h1"].returncode != 0
        assert "RankFailedError" in text and "rank 2 on h2" in text and "rank 3 on h2" in text, job.tail()
        assert "no HOROVOD_SECRET_KEY" not in text  # the ssh launch made one and carried it
        assert _left(c, set()) == {}


@pytest.mark.timeout(240)
def test_ssh_launch_a_cut_link_stops_both_sides_within_30_s(tmp_path: Path) -> None:
    with cluster(2) as c:
        job, sshd = _ssh_job(tmp_path, c)
        cut_at = time.monotonic()
        c.cut(c.host("h2"))
        waited = job.exit_times(cut_at, timeout=60)["h1"]
        print(f"\nFAULT-TIME ssh partition: hvdrun on h1 exited {waited} s after the cut "
              f"(exit code {job.procs['h1'].returncode})")
        text = job.text("h1")
        assert waited is not None and waited < 30.0, job.tail()
        assert job.procs["h1"].returncode != 0
        assert "rank 0 on h1 has not heard from h2 (ranks 2, 3)" in text, job.tail()
        # h2's own processes stop by themselves (their output cannot reach h1 any more)
        left = _left(c, sshd, grace_seconds=20.0)
        gone = time.monotonic() - cut_at
        print(f"FAULT-TIME ssh partition: every job process gone {gone:.1f} s after the cut")
        assert left == {}, left
        assert time.monotonic() - cut_at < 45

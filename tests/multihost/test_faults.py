"""Faults across hosts, end to end: 2 hosts x 2 processes, the same hvdrun line run on each.

* partition: h2's link is cut mid-training. Every rank stops within 30 s with the default
  ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (10 s by default) naming the other host, both hvdruns exit non-zero,
  and no process is left on either host.
* the same partition while every step is ZeRO stage 2's traffic: every rank stops (40 s bound).
* host killed: every process of h2 is SIGKILLed. The ranks on h1 raise RankFailedError naming h2
  and its ranks, hvdrun on h1 exits non-zero within 10 s, and no process is left.

Each test prints the measured times (``FAULT-TIME ...`` lines, run pytest with ``-s``).
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from tests.multihost.faults_helpers import SCRIPTS, Job, start_job
from tests.multihost.netns import Cluster, cluster

PORT = "29400"
HVDRUN = os.path.join(os.path.dirname(sys.executable), "hvdrun")


def _hvdrun(script: str, *flags: str) -> list[str]:
    return [HVDRUN, "-np", "4", "-H", "h1:2,h2:2", "--port", PORT, "--no-ssh", *flags, sys.executable,
            str(SCRIPTS / script)]


def _s(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f} s"


def _started(c: Cluster, argv: list[str], at_step: int = 20) -> Job:
    job = start_job(c, c.hosts, argv)
    for host in ("h1", "h2"):
        assert job.wait_for(host, f"step {at_step} on", timeout=120), f"{host} never trained:\n{job.tail()}"
    return job


def _found(text: str, rank: int, own_line: str) -> bool:
    """``rank`` reported the partition: its own error line, or hvdrun's summary lists its record.

    The first rank to raise exits, and torchrun's agent then SIGTERMs its siblings, sometimes
    before their traceback reaches the log; their record in the job directory is still read by
    hvdrun, whose ``network partition`` line names them (``ranks 1 found it too``).
    """
    if own_line in text:
        return True
    for line in text.splitlines():
        if line.startswith("hvdrun: error: network partition:") and "found it too" in line:
            listed = line.rpartition("(ranks ")[2].partition(" found it too")[0]
            if str(rank) in [r.strip() for r in listed.split(",")]:
                return True
    return False


def _no_process_left(c: Cluster, job: Job) -> None:
    deadline = time.monotonic() + 5  # the last workers may still be reaping
    while any(c.pids().values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(c.pids().values()), f"processes left: {c.pids()}\n{job.tail()}"


def _cut_and_await_both(c: Cluster, job: Job, label: str, *, bound: float) -> float:
    """Cut h2's link; assert both hvdruns exit non-zero within ``bound`` seconds of the cut
    (printed as a ``FAULT-TIME`` line); return the cut's ``time.monotonic()``."""
    cut_at = time.monotonic()
    c.cut(c.host("h2"))
    waited = job.exit_times(cut_at, timeout=60)
    codes = {name: job.procs[name].returncode for name in waited}
    print(f"\nFAULT-TIME {label}: hvdrun exited after the cut: h1 {_s(waited['h1'])}, "
          f"h2 {_s(waited['h2'])} (exit codes {codes})")
    for name in ("h1", "h2"):
        assert waited[name] is not None and waited[name] < bound, f"{name}: {waited}\n{job.tail()}"
        assert codes[name] != 0, job.tail()
    return cut_at


@pytest.mark.timeout(240)
def test_a_cut_link_stops_every_rank_within_30_s_naming_the_other_host() -> None:
    with cluster(2) as c:
        job = _started(c, _hvdrun("fault_loop.py"), at_step=40)
        cut_at = _cut_and_await_both(c, job, "partition", bound=30.0)
        h1_text, h2_text = job.text("h1"), job.text("h2")
        # the ranks on h1 raise the error in their collective, naming h2 and its ranks
        assert "HostUnreachableError: allreduce 'ones'" in h1_text, job.tail()
        for rank in (0, 1):
            assert _found(h1_text, rank, f"rank {rank} on h1 has not heard from h2 (ranks 2, 3)"), job.tail()
        # the ranks on h2 (blocked on the unreachable store) stop, naming h1 and its ranks
        for rank in (2, 3):
            assert _found(h2_text, rank, f"rank {rank} on h2 cannot reach the job's store at h1:"), job.tail()
        assert "this host is cut off from h1; unreachable: h1 (ranks 0, 1)" in h2_text, job.tail()
        assert "hvdrun: error: network partition: rank 0 on h1 has not heard from h2" in h1_text
        assert "hvdrun: error: network partition: rank 2 on h2 cannot reach" in h2_text
        for name in ("h1", "h2"):
            raised = job.first(name, "HostUnreachableError", after=cut_at)
            assert raised is not None
            print(f"FAULT-TIME partition: first HostUnreachableError on {name} {raised - cut_at:.1f} s "
                  "after the cut")
        _no_process_left(c, job)


@pytest.mark.timeout(240)
def test_a_cut_link_inside_zero_transfers_stops_every_rank_within_40_s() -> None:
    """The same cut while every step is ZeRO stage 2's traffic (reduce-scatter, shard transfers).
    Measured 11-15 s here (the 10 s peer timeout first); 40 s leaves room for a loaded CI host."""
    with cluster(2) as c:
        job = start_job(c, c.hosts, _hvdrun("fault_loop.py"), env={**os.environ, "FAULT_LOOP_ZERO": "1"})
        for host in ("h1", "h2"):
            assert job.wait_for(host, "step 100 on", timeout=120), f"{host} never trained:\n{job.tail()}"
        _cut_and_await_both(c, job, "partition in ZeRO", bound=40.0)
        assert "hvdrun: error: network partition: rank " in job.text("h1"), job.tail()
        assert "this host is cut off from h1; unreachable: h1 (ranks 0, 1)" in job.text("h2"), job.tail()
        _no_process_left(c, job)


@pytest.mark.timeout(240)
def test_a_killed_host_makes_the_survivors_name_it_and_hvdrun_exit_within_10_s() -> None:
    with cluster(2) as c:
        job = _started(c, _hvdrun("fault_loop.py"))
        killed_at = time.monotonic()
        c.kill_host(c.host("h2"))
        waited = job.exit_times(killed_at, timeout=30)["h1"]
        print(f"\nFAULT-TIME host kill: hvdrun on h1 exited {_s(waited)} after h2 was killed "
              f"(exit code {job.procs['h1'].returncode})")
        assert waited is not None and waited < 10.0, job.tail()
        assert job.procs["h1"].returncode != 0
        text = job.text("h1")
        assert text.count("RankFailedError") >= 2, job.tail()  # both ranks on h1 raised it
        for rank in (0, 1):
            assert f"[{rank}]<stderr>" in text, job.tail(80)
        assert "rank 2 on h2" in text and "rank 3 on h2" in text, job.tail()
        # no rank on h1 blames its neighbour, which only left because it lost h2 too
        assert "no longer running" not in text, job.tail()
        # hvdrun's verdict does not blame an early return on this host: the cause is on h2
        assert "do not return early" not in text, job.tail()
        verdict = [line for line in text.splitlines() if line.startswith("hvdrun: error: rank ")]
        assert len(verdict) == 1, job.tail()
        if "signal" not in verdict[0]:  # every rank on h1 only reports that a peer failed
            assert "No rank on this host failed on its own" in verdict[0], job.tail()
        _no_process_left(c, job)

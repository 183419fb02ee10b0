"""Elastic training across namespace hosts: a host is killed mid-epoch (SIGKILL of everything on it).

* world size kept (3 hosts, ``--min-np 4 --max-np 4``): h3's agent waits as a spare; when h2 is
  killed, h1 and h3 continue from the last commit, and the final weights are bit-identical to an
  uninterrupted 4-rank run's.
* world size changes (2 hosts, ``--min-np 2 --max-np 4``, the default ``--start-timeout``): h1
  continues alone from the last commit (the re-form outlasts the start timeout: it waits
  ``--elastic-timeout``); a copy of the line with another secret on h2 is refused without
  restarting h1's workers; h2's hvdrun is started again and is taken in at the next rendezvous
  (h1 alone holds after step 18 until then).

Both print the seconds from the kill to the resumed start (``FAULT-TIME ...``, pytest ``-s``).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.multihost.faults_helpers import SCRIPTS, Job, start_job
from tests.multihost.netns import cluster

HVDRUN = os.path.join(os.path.dirname(sys.executable), "hvdrun")
WORKER = str(SCRIPTS / "elastic_hosts.py")
STEPS = 36  # 3 epochs x 192 samples / (4 ranks x batch 4)


def _line(hosts: str, np_range: tuple[int, int], run_dir: Path, out: Path,
          start_timeout: str | None = "90") -> list[str]:
    timeout = [] if start_timeout is None else ["--start-timeout", start_timeout]
    return [HVDRUN, "-np", "4", "-H", hosts, "--min-np", str(np_range[0]), "--max-np", str(np_range[1]),
            "--recovery", "restart", "--port", "29400", "--no-ssh", *timeout, sys.executable, WORKER,
            str(run_dir), str(out)]


def _last_commit(job: Job, host: str, before: float) -> int:
    commits = [int(m.group(1)) for t, line in job.lines[host] if t < before
               and (m := re.search(r"COMMIT (\d+) rank=0", line))]
    assert commits, job.tail()
    return commits[-1]


def _resumed(job: Job, host: str, after: float, world: int) -> tuple[float, int] | None:
    """(time, step) of the first START of rank 0 in a world of ``world`` after ``after``."""
    for t, line in job.lines[host]:
        m = re.search(rf"START rank=0 world={world} host=\w+ attempt=\d+ step=(\d+)", line)
        if t > after and m:
            return t, int(m.group(1))
    return None


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def _connected(host, addr: str, port: int) -> bool:
    """Whether a process on ``host`` holds an established TCP connection to ``addr:port`` (IPv4,
    or IPv4-mapped IPv6 as torch's store client connects): the spare's agent reached the store."""
    out = host.run(["ss", "-tnH", "state", "established"], timeout=30).stdout
    peers = {f"{addr}:{port}", f"[::ffff:{addr}]:{port}"}
    return any(line.split()[-1] in peers for line in out.splitlines() if line.split())


def _kill_mid_epoch(c, job: Job, host: str = "h2", at_step: int = 16) -> float:
    assert job.wait_for("h1", f"STEP {at_step} rank=0 world=4", timeout=150), job.tail()
    killed_at = time.monotonic()
    c.kill_host(c.host(host))
    return killed_at


@pytest.mark.timeout(420)
def test_a_lost_host_is_replaced_by_a_spare_and_the_weights_equal_an_uninterrupted_run(tmp_path) -> None:
    with cluster(3) as c:
        h1, h2, h3 = c.hosts
        # the reference run is never interrupted: no pacing sleep per step (the values do not depend on it)
        ref = h1.run([HVDRUN, "-np", "4", sys.executable, WORKER, str(tmp_path / "ref"),
                      str(tmp_path / "ref.pt")], env={**os.environ, "ELASTIC_STEP_SLEEP": "0"}, timeout=180)
        assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
        line = _line("h1:2,h2:2,h3:2", (4, 4), tmp_path / "run", tmp_path / "run.pt")
        hold = tmp_path / "hold"  # the job waits after step 14 until the spare has reached the rendezvous
        hold.touch()
        job = start_job(c, [h1, h2], line, env={**os.environ, "ELASTIC_HOLD_FILE": str(hold)})
        assert job.wait_for("h1", "STEP 2 rank=0 world=4", timeout=150), job.tail()
        spare = start_job(c, [h3], line)  # joins the rendezvous as a spare: the world is full
        assert _wait(lambda: _connected(h3, h1.addr, 29400) or spare.procs["h3"].poll() is not None,
                     90), spare.tail()
        assert spare.procs["h3"].poll() is None, spare.tail()
        hold.unlink()
        killed_at = _kill_mid_epoch(c, job)
        last = _last_commit(job, "h1", killed_at)
        assert _wait(lambda: job.procs["h1"].poll() is not None and spare.procs["h3"].poll() is not None,
                     300), job.tail() + spare.tail()
        codes = (job.procs["h1"].returncode, spare.procs["h3"].returncode)
        assert codes == (0, 0), job.tail() + spare.tail()
        resumed = _resumed(job, "h1", killed_at, world=4)
        assert resumed is not None, job.tail()
        print(f"\nFAULT-TIME elastic spare: resumed on h1+h3 {resumed[0] - killed_at:.1f} s after h2 was "
              f"killed, from step {resumed[1]} (last commit seen before the kill: step {last})")
        assert resumed[1] == last, job.tail()  # nothing committed was lost
        assert "START rank=2 world=4 host=h3" in spare.text("h3"), spare.tail()
        assert f"DONE rank=0 world=4 host=h1 step={STEPS}" in job.text("h1")
        want, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "run.pt")
        assert got["step"] == want["step"] == STEPS
        for name, tensor in want["model"].items():
            assert torch.equal(got["model"][name], tensor), name  # bit-identical
        assert got["seen"] == want["seen"]
        assert not any(c.pids().values()), c.pids()


@pytest.mark.timeout(420)
def test_training_continues_on_the_remaining_host_and_a_host_that_comes_back_is_taken_in(tmp_path) -> None:
    with cluster(2) as c:
        h1, h2 = c.hosts
        # the default --start-timeout (30 s): the re-form after the loss takes longer (~45 s: torch
        # notices the lost agent, then waits its last call) and waits --elastic-timeout (600 s)
        line = _line("h1:2,h2:2", (2, 4), tmp_path / "run", tmp_path / "run.pt", start_timeout=None)
        # h1 alone (world 2) holds after step 18 until h2 is back: alone it would finish its last
        # steps in ~10 s, sooner than a loaded machine runs the stranger and h2's line
        hold = tmp_path / "hold"
        hold.touch()
        job = start_job(c, [h1, h2], line, env={**os.environ, "ELASTIC_HOLD_FILE": str(hold),
                                                 "ELASTIC_HOLD_STEP": "18", "ELASTIC_HOLD_WORLD": "2"})
        killed_at = _kill_mid_epoch(c, job)
        last = _last_commit(job, "h1", killed_at)
        assert _wait(lambda: _resumed(job, "h1", killed_at, world=2) is not None, 150), job.tail()
        alone_at, alone_step = _resumed(job, "h1", killed_at, world=2)
        print(f"\nFAULT-TIME elastic shrink: h1 resumed alone {alone_at - killed_at:.1f} s after h2 was "
              f"killed, from step {alone_step} (last commit seen before the kill: step {last})")
        assert alone_step == last, job.tail()  # nothing committed was lost
        assert job.wait_for("h1", "STEP", timeout=60)
        knocked_at = time.monotonic()  # a stranger's copy of the line must not re-form h1's world
        stranger = h2.run(line, env={**os.environ, "HOROVOD_SECRET_KEY": "a-strangers-secret"}, timeout=90)
        assert stranger.returncode != 0 and "hvdrun: refused:" in stranger.stderr, stranger.stderr[-2000:]
        back_at = time.monotonic()
        assert _resumed(job, "h1", knocked_at, world=2) is None, job.tail()  # h1 was not restarted
        back = start_job(c, [h2], line)  # the host comes back
        assert _wait(lambda: _resumed(job, "h1", back_at, world=4) is not None, 150), job.tail() + back.tail()
        hold.unlink()
        grown_at, grown_step = _resumed(job, "h1", back_at, world=4)
        print(f"FAULT-TIME elastic grow: h2 taken in {grown_at - back_at:.1f} s after its hvdrun started, "
              f"at step {grown_step}")
        assert grown_step >= alone_step
        assert _wait(lambda: job.procs["h1"].poll() is not None and back.procs["h2"].poll() is not None, 200)
        assert job.procs["h1"].returncode == 0 and back.procs["h2"].returncode == 0, job.tail() + back.tail()
        assert "DONE rank=2 world=4 host=h2" in back.text("h2"), back.tail()
        got = torch.load(tmp_path / "run.pt")
        for epoch in range(3):  # every sample exactly once per epoch, across the resizes
            indices = sorted(i for e, batch in got["seen"] if e == epoch for i in batch)
            assert indices == list(range(192)), epoch
        assert not any(c.pids().values()), c.pids()

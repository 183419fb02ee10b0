"""Nobody joins who does not belong (the job secret), end to end across namespace hosts.

* A stranger: h2 runs the job's hvdrun line with another ``HOROVOD_SECRET_KEY``. Its agent gets
  into the rendezvous (same port, same command), but at init every rank checks every rank's
  proof: the job stops before any step, h1's ranks naming h2's ranks, and nothing is left behind.
* A foreign process that connects to the rendezvous port during start-up and sends junk is
  ignored: the job (h1 and h2, one secret) trains to the end.
* A single-host job listens on loopback only.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.multihost.faults_helpers import SCRIPTS, start_job
from tests.multihost.netns import cluster

PORT = "29400"
HVDRUN = os.path.join(os.path.dirname(sys.executable), "hvdrun")
LINE = [HVDRUN, "-np", "4", "-H", "h1:2,h2:2", "--port", PORT, "--no-ssh", sys.executable,
        str(SCRIPTS / "fault_loop.py")]


def _env(secret: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HOROVOD_SECRET_KEY"}
    if secret is not None:
        env["HOROVOD_SECRET_KEY"] = secret
    env.update(extra)
    return env


def _left(c) -> dict[str, list[int]]:
    deadline = time.monotonic() + 5
    while any(c.pids().values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {k: v for k, v in c.pids().items() if v}


@pytest.mark.timeout(200)
def test_an_agent_with_another_secret_stops_the_job_at_init_naming_its_ranks() -> None:
    with cluster(2) as c:
        h1, h2 = c.hosts
        procs = {
            "h1": h1.popen(LINE, env=_env("the-jobs-secret"), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True),
            "h2": h2.popen(LINE, env=_env("a-strangers-secret"), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True),
        }
        out = {name: p.communicate(timeout=150)[0] for name, p in procs.items()}
        for name, p in procs.items():
            assert p.returncode != 0, out[name]
        tail = out["h1"][-3000:]
        assert "JobSecretError" in out["h1"], tail
        assert "joined this job without its secret (HOROVOD_SECRET_KEY)" in out["h1"], tail
        for rank in (2, 3):
            assert f"rank {rank} (pid " in out["h1"], tail
        assert " on h2)" in out["h1"], tail
        assert "step 0" not in out["h1"] + out["h2"]  # refused at init: not a single step together
        for text in out.values():
            assert "the-jobs-secret" not in text and "a-strangers-secret" not in text
        assert _left(c) == {}


def _poke(host_port: tuple[str, int], stop_at: float, stop_file: str | None = None) -> int:
    """Connect to the rendezvous port again and again, sending junk, until ``stop_at`` or until
    ``stop_file`` exists (the test makes it once the job ended); returns the connections made."""
    made = 0
    while time.monotonic() < stop_at and not (stop_file and os.path.exists(stop_file)):
        try:
            with socket.create_connection(host_port, timeout=1) as sock:
                sock.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(64))
                made += 1
        except OSError:
            pass
        time.sleep(0.2)
    return made


@pytest.mark.timeout(200)
def test_a_foreign_connection_during_start_up_is_ignored_and_the_job_trains(tmp_path) -> None:
    with cluster(3) as c:
        h1, h2, h3 = c.hosts
        stop = tmp_path / "stop-poking"
        job = start_job(c, [h1, h2], LINE, env=_env("shared-secret", FAULT_LOOP_STEPS="60"))
        poke = (f"import socket, time, os, sys; sys.path.insert(0, {str(SCRIPTS.parents[2])!r}); "
                "from tests.multihost.test_faults_secret import _poke; "
                f"print('connections', _poke(('{h1.addr}', {PORT}), time.monotonic() + 20, {str(stop)!r}))")
        # pokes all through the job's start-up (at most 20 s), and stops once the job ended
        poker = h3.popen([sys.executable, "-c", poke], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        ended = job.exit_times(time.monotonic(), timeout=120)
        stop.touch()
        poke_out, poke_err = poker.communicate(timeout=60)
        assert poker.returncode == 0, poke_err
        made = int(poke_out.split()[-1])
        print(f"\nforeign connections to the rendezvous port during start-up: {made}")
        assert made > 0, "the foreign process never reached the port"
        for name in ("h1", "h2"):
            assert ended[name] is not None and job.procs[name].returncode == 0, job.tail()
        assert "finished rank 0 on h1" in job.text("h1") and "finished rank 3 on h2" in job.text("h2")
        assert "shared-secret" not in job.text("h1") + job.text("h2")
        assert _left(c) == {}


@pytest.mark.timeout(120)
def test_a_single_host_job_listens_on_loopback_only() -> None:
    with cluster(1) as c:
        h1 = c.hosts[0]
        job = start_job(c, [h1], [HVDRUN, "-np", "2", sys.executable, str(SCRIPTS / "fault_loop.py")],
                        env=_env(None))
        assert job.wait_for("h1", "step 20 on h1", timeout=90), job.tail()
        listening = h1.run(["ss", "-ltnH"], timeout=30).stdout.split("\n")
        addrs = [line.split()[3] for line in listening if line.strip()]
        assert addrs, "nothing listens while the job runs?"
        assert all(a.startswith(("127.0.0.1:", "[::1]:", "[::ffff:127.0.0.1]:")) for a in addrs), addrs
        c.kill_host(h1)

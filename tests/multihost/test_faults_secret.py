"""Nobody joins who does not belong (the job secret), end to end across namespace hosts.

* Strangers at the door: while h1 waits for h2, a second copy of the line with the job's own
  secret on h1 is refused, and junk written into the public door mark from a third host does not
  keep h2 out; while the 2-host job runs, its line is started again with another
  ``HOROVOD_SECRET_KEY`` (on each host, and on a third host posing as h2), with none, and with
  the job's own (a second copy of a full job): each is refused within seconds
  (``hvdrun: refused: ...``) and the job trains to the end without a restart
  (:mod:`hvd_trainer.launch.guarded_rdzv`).
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


def _knock(host, secret: str | None, extra: tuple[str, ...] = ()) -> tuple[int, str, float]:
    """Run the job's line once more on ``host`` with ``secret`` (and ``extra`` hvdrun options);
    ``(exit status, output, seconds)``."""
    begin = time.monotonic()
    done = host.run([LINE[0], *extra, *LINE[1:]], env=_env(secret), timeout=90)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - begin


def _check_refused(what: str, code: int, out: str, took: float, reason: str) -> None:
    print(f"\n{what}: exit {code} after {took:.1f} s: {out.strip().splitlines()[-1]}")
    assert code != 0, (what, out[-2000:])
    assert "hvdrun: refused:" in out and reason in out, (what, out[-2000:])
    assert "step 0" not in out and "Traceback" not in out, (what, out[-2000:])
    assert took < 30, (what, took)
    assert "the-jobs-secret" not in out and "a-strangers-secret" not in out


def _listening(host, port: str) -> bool:
    return any(line.split()[3].endswith(f":{port}")
               for line in host.run(["ss", "-ltnH"], timeout=30).stdout.splitlines() if line.strip())


JUNK = ("from datetime import timedelta; from torch.distributed import TCPStore; "
        "from hvd_trainer.launch.guarded_rdzv import UP_KEY; "
        "store = TCPStore({addr!r}, {port}, is_master=False, timeout=timedelta(seconds=30)); "
        "store.set(UP_KEY, b'\\xff\\xfe junk')")


@pytest.mark.timeout(240)
def test_strangers_are_refused_at_the_door_and_the_job_trains_on(tmp_path) -> None:
    """h1 waiting for h2: a second copy on h1 with the job's secret is refused, and junk a third
    host writes into the public door mark keeps nobody out. A running 2-host job: the same line
    started again with another secret (on the store's host and on the other), with no secret, and
    with the job's own secret (a second copy): each is refused at once with a named error, and
    the job trains to the end untouched."""
    with cluster(3) as c:
        h1, h2, h3 = c.hosts
        stop = tmp_path / "stop"
        env = _env("the-jobs-secret", FAULT_LOOP_STOP_FILE=str(stop))
        job = start_job(c, [h1], LINE, env=env)
        deadline = time.monotonic() + 60
        while not _listening(h1, PORT) and time.monotonic() < deadline:
            time.sleep(0.1)
        _check_refused("a second copy on h1 before h2 came", *_knock(h1, "the-jobs-secret"),
                       "already hosts its rendezvous")
        junk = h3.run([sys.executable, "-c", JUNK.format(addr=h1.addr, port=PORT)], timeout=60)
        assert junk.returncode == 0, junk.stderr
        joiner = start_job(c, [h2], LINE, env=env)  # h2 comes after the junk
        job.procs["h2"], job.lines["h2"] = joiner.procs["h2"], joiner.lines["h2"]
        assert job.wait_for("h1", "step 10 on h1", timeout=90), job.tail()
        tries = {
            "another secret on h2": (h2, "a-strangers-secret", (), "holds another secret"),
            "another secret on h1": (h1, "a-strangers-secret", (), "holds another secret"),
            "no secret on h2": (h2, None, (), "holds another secret"),
            "another secret on h3 posing as h2": (h3, "a-strangers-secret", ("--this-host", "h2"),
                                                  "holds another secret"),
            "a second copy on h2": (h2, "the-jobs-secret", (), "already running with all its 2 host(s)"),
        }
        for what, (host, secret, extra, reason) in tries.items():
            _check_refused(what, *_knock(host, secret, extra), reason)
        stop.touch()
        ended = job.exit_times(time.monotonic(), timeout=120)
        for name in ("h1", "h2"):
            assert ended[name] is not None and job.procs[name].returncode == 0, job.tail()
        assert "finished rank 0 on h1" in job.text("h1") and "finished rank 3 on h2" in job.text("h2")
        assert "restart" not in job.text("h1") + job.text("h2")
        assert "ready rank 0 of 4" in job.text("h1") and "of 5" not in job.text("h1") + job.text("h2")
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

"""One command starts the whole job: ``hvdrun`` on h1 starts h2's agent over a real sshd.

Each test starts OpenSSH's sshd inside h2 (a host key and a user key made by the test, a known_hosts
file of the test) and runs hvdrun on h1 only; h1 itself is reached without ssh (it has no sshd).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.hvdrun_helpers import clean_env
from tests.multihost.helpers import HVDRUN, SCRIPTS, explain, records, run_on_hosts
from tests.multihost.netns import Cluster, cluster
from tests.multihost.sshd import hvdrun_ssh_args, make_keys, ssh_skip_reason, start_sshd

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(ssh_skip_reason() is not None, reason=str(ssh_skip_reason()))]


def _left_over(c: Cluster, sshd_pids: set[int], grace_seconds: float = 10.0) -> dict[str, list[int]]:
    """Processes still in the hosts' namespaces (besides the test's sshd) after a grace period."""
    deadline = time.monotonic() + grace_seconds
    while True:
        left = {name: [p for p in pids if p not in sshd_pids] for name, pids in c.pids().items()}
        if not any(left.values()) or time.monotonic() > deadline:
            return {k: v for k, v in left.items() if v}
        time.sleep(0.2)


def _job(tmp_path: Path, c: Cluster) -> tuple[list[str], set[int]]:
    keys = make_keys(tmp_path / "keys")
    h2 = c.host("h2")
    start_sshd(h2, keys)
    sshd = set(h2.pids())
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(SCRIPTS / "probe.py", work / "probe.py")
    return hvdrun_ssh_args(keys), sshd


def test_one_command_starts_every_host_with_cwd_and_environment(tmp_path: Path) -> None:
    with cluster(2) as c:
        ssh_args, sshd = _job(tmp_path, c)
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("h1 slots=2\nh2 slots=2\n")
        start = time.monotonic()
        (run,) = run_on_hosts([c.host("h1")], [*HVDRUN, "-np", "4", "--hostfile", str(hostfile), *ssh_args,
                                               "python", "probe.py"],
                              env=clean_env(HOROVOD_TEST_MARK="carried"), cwd=str(tmp_path / "work"))
        print(f"ssh launch 2 hosts x 2 processes: {time.monotonic() - start:.1f} s")
        assert run.returncode == 0, explain([run])
        got = {int(rank): info for rank, info in records(run.output, "PROBE")}
        assert sorted(got) == [0, 1, 2, 3], explain([run])
        assert {got[r]["host"] for r in got} == {"h1", "h2"}
        assert sorted(info["host"] for info in got.values()) == ["h1", "h1", "h2", "h2"]
        for info in got.values():
            assert info["cwd"] == str(tmp_path / "work")
            assert info["mark"] == "carried"
            assert info["sum"] == 10.0
        assert _left_over(c, sshd) == {}


def test_a_failing_remote_rank_stops_every_host(tmp_path: Path) -> None:
    with cluster(2) as c:
        ssh_args, sshd = _job(tmp_path, c)
        (run,) = run_on_hosts([c.host("h1")], [*HVDRUN, "-np", "4", "-H", "h1:2,h2:2", *ssh_args,
                                               "python", "probe.py", "--fail-rank", "3"],
                              cwd=str(tmp_path / "work"), timeout=120)
        hosts = {int(rank): info["host"] for rank, info in records(run.output, "PROBE")}
        assert hosts.get(3) == "h2", explain([run])
        assert run.returncode != 0, explain([run])
        assert "rank 3" in run.output and "fails on purpose" in run.output, explain([run])
        fail_at = float(run.output.split("FAIL_AT ")[1].split()[0])
        print(f"remote rank failure: hvdrun on h1 exited {run.seconds:.1f} s after start, "
              f"{time.time() - fail_at:.1f} s (upper bound) after the failure")
        assert time.time() - fail_at < 30, explain([run])
        assert _left_over(c, sshd) == {}, explain([run])


def test_ctrl_c_stops_every_host(tmp_path: Path) -> None:
    with cluster(2) as c:
        ssh_args, sshd = _job(tmp_path, c)
        proc = c.host("h1").popen([*HVDRUN, "-np", "4", "-H", "h1:2,h2:2", *ssh_args, "python", "probe.py",
                                   "--sleep", "300"], env=clean_env(), cwd=str(tmp_path / "work"),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while sum("READY " in line for line in lines) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-30:])
            time.sleep(0.2)
        ready = {int(r): info for r, info in records("".join(lines), "READY")}
        assert sorted(info["host"] for info in ready.values()) == ["h1", "h1", "h2", "h2"]
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        took = time.monotonic() - sent
        reader.join(timeout=10)
        print(f"Ctrl-C: hvdrun exited {took:.1f} s after SIGINT with status {code}")
        assert code != 0 and took < 30, "".join(lines[-30:])
        left = _left_over(c, sshd)
        print(f"Ctrl-C: every host empty {time.monotonic() - sent:.1f} s after SIGINT")
        assert left == {}, (left, "".join(lines[-30:]))

"""The namespace fixture itself: separate hostnames, names that resolve, cut/heal, full teardown."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multihost.netns import cluster

pytestmark = pytest.mark.timeout(120)

SERVE = ("import socket, sys\n"
         "s = socket.create_server(('0.0.0.0', 7000))\n"
         "print('ready', flush=True)\n"
         "while True:\n"
         "    c, _ = s.accept(); c.sendall(socket.gethostname().encode()); c.close()\n")
ASK = ("import socket, sys\n"
       "try:\n"
       "    c = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))\n"
       "    print(c.recv(100).decode())\n"
       "except OSError as e:\n"
       "    print('unreachable', type(e).__name__); sys.exit(3)\n")


def _ask(host, target: str, timeout: float = 3.0) -> subprocess.CompletedProcess:
    return host.run([sys.executable, "-c", ASK, target, str(timeout)], timeout=30)


def _root_links() -> set[str]:
    """Links of the root namespace named like the fixture's (peers ``pKlL``, bridges, ``ethL``)."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    names = {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}
    return {n for n in names if re.fullmatch(r"p\d+l\d+|br\d+", n)}


def test_two_hosts_hostnames_names_cut_heal_teardown() -> None:
    with cluster(2) as c:
        h1, h2 = c.hosts
        names = [h.run(["hostname"]).stdout.strip() for h in c.hosts]
        assert names == ["h1", "h2"]
        assert h1.run(["getent", "hosts", "h2"]).stdout.split()[0] == h2.addr
        server = h2.popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        got = _ask(h1, "h2")
        assert (got.returncode, got.stdout.strip()) == (0, "h2"), got
        c.cut(h2)
        t0 = time.monotonic()
        cut = _ask(h1, "h2", timeout=2.0)
        assert cut.returncode == 3 and "unreachable" in cut.stdout, cut
        assert time.monotonic() - t0 < 20
        c.heal(h2)
        healed = _ask(h1, "h2", timeout=5.0)
        assert (healed.returncode, healed.stdout.strip()) == (0, "h2"), healed
        assert server.pid in h2.pids()
        c.kill_host(h2)
        assert h2.pids() == []
        assert server.poll() is not None
        made = [h.netns for h in c.hosts] + [c.switch]
        h1.popen(["sleep", "300"])  # teardown must kill this too
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [ns for ns in made if ns in listed], listed
    for ns in made:
        assert not (Path("/etc/netns") / ns).exists()


def test_teardown_on_failure_and_root_namespace_untouched() -> None:
    before = _root_links()
    made: list[str] = []
    with pytest.raises(RuntimeError, match="boom"), cluster(3, links=2) as c:
        made = [h.netns for h in c.hosts] + [c.switch]
        assert [h.addrs[1].rsplit(".", 1)[1] for h in c.hosts] == ["11", "12", "13"]
        got = c.hosts[0].run(["ip", "-o", "-4", "addr", "show", "dev", "eth1"]).stdout
        assert c.hosts[0].addrs[1] in got
        c.hosts[2].popen(["sleep", "300"])
        raise RuntimeError("boom")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert made and not [ns for ns in made if ns in listed], listed
    assert _root_links() - before == set()

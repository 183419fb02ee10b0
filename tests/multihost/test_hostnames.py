"""Hostname pitfalls and ``--network-interface`` across namespace hosts (same-line mode).

* Two hosts with one hostname and addresses in ``-H``: torchrun alone cannot tell which agent
  hosts the rendezvous; hvdrun tells each agent (c10d ``is_host``), so the job runs.
* The shared hostname itself first in ``-H``: every host stops at once with one line and the fix,
  instead of waiting 60 s for a C++ ``DistNetworkError``.
* ``--network-interface eth1`` on hosts with two links: the collectives' bytes go over eth1.
"""

from __future__ import annotations

import sys
import time

import pytest

from tests.multihost.helpers import HVDRUN, SCRIPTS, explain, records, run_on_hosts
from tests.multihost.netns import cluster

pytestmark = pytest.mark.timeout(180)


def _hvdrun(spec: str, *flags: str, script: str = "probe.py") -> list[str]:
    return [*HVDRUN, "-np", "4", "-H", spec, "--no-ssh", "--start-timeout", "20", *flags,
            sys.executable, str(SCRIPTS / script)]


def test_shared_hostname_with_addresses_in_H_runs() -> None:
    with cluster(2, hostnames=["node", "node"]) as c:
        assert {h.run(["hostname"]).stdout.strip() for h in c.hosts} == {"node"}
        spec = ",".join(f"{h.addr}:2" for h in c.hosts)
        runs = run_on_hosts(c.hosts, _hvdrun(spec), timeout=150)
        assert [r.returncode for r in runs] == [0, 0], explain(runs)
        got = {int(rank): info for rank, info in records("\n".join(r.output for r in runs), "PROBE")}
        assert sorted(got) == [0, 1, 2, 3] and {info["sum"] for info in got.values()} == {10.0}, explain(runs)


def test_shared_hostname_first_in_H_is_one_line_with_the_fix() -> None:
    with cluster(2, hostnames=["node", "node"]) as c:
        start = time.monotonic()
        runs = run_on_hosts(c.hosts, _hvdrun(f"node:2,{c.hosts[1].addr}:2"), timeout=60)
        took = max(r.seconds for r in runs)
        print(f"shared hostname first in -H: both hosts stopped after {took:.1f} s")
        for run in runs:
            assert run.returncode == 2, explain(runs)
            errors = [line for line in run.output.splitlines() if line.startswith("hvdrun: error:")]
            assert len(errors) == 1, explain(runs)
            assert "this host is named 'node', the first host of -H (the rendezvous host)" in errors[0]
            assert "HINT: put this machine's address first in -H" in errors[0]
            assert "DistNetworkError" not in run.output and "Traceback" not in run.output
        assert time.monotonic() - start < 30, explain(runs)


def test_network_interface_carries_the_collectives() -> None:
    with cluster(2, links=2) as c:
        runs = run_on_hosts(c.hosts, _hvdrun("h1:2,h2:2", "--network-interface", "eth1",
                                             script="iface_bytes.py"), timeout=150)
        assert [r.returncode for r in runs] == [0, 0], explain(runs)
        sent = {int(rank): counts for rank, counts in records("\n".join(r.output for r in runs), "IFACE")}
        assert sorted(sent) == [0, 1, 2, 3], explain(runs)
        print(f"--network-interface eth1: bytes sent per host during 64 MiB of allreduce: {sent}")
        for counts in sent.values():
            assert counts["eth1"] > 16 * 2**20, sent  # ring allreduce: ~2x the data leaves each host
            assert counts["eth0"] < 2**20, sent

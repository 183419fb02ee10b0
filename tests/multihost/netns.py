"""Several "hosts" on one machine: network + UTS namespaces joined by a switch namespace.

Each host ``hK`` is a network namespace with its own hostname (every command runs in a fresh UTS
namespace whose hostname is set to ``hK``) and one veth interface (``eth0``, more with
``links=``) whose peer sits on a bridge inside a dedicated switch namespace. Nothing is added to
the root namespace: traffic flows only between the test's own namespaces (and each namespace's
own loopback). The names ``h1..hN`` exist only inside the test: ``ip netns exec`` bind-mounts
``/etc/netns/<ns>/hosts`` over ``/etc/hosts``.

Names and addresses carry a random suffix / a random ``10.(200-250).x.0/24`` per link, so two
test runs at once never collide. :func:`cluster` always tears everything down (processes,
namespaces, veths, ``/etc/netns`` folders), also on failure or timeout.

Example::

    with cluster(2) as c:
        h1, h2 = c.hosts
        assert h1.run(["ping", "-c1", "-W1", "h2"]).returncode == 0
        c.cut(h2)          # h2's link goes down: a network partition
        c.heal(h2)
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Cluster", "Host", "NetnsError", "cluster", "skip_reason"]

ETC_NETNS = Path("/etc/netns")
_SET_HOSTNAME = 'hostname "$HVT_HOSTNAME" && exec "$@"'


class NetnsError(RuntimeError):
    """A namespace command failed (the command and its stderr are in the message)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed (rc={proc.returncode}): {proc.stderr.strip()}")
    return proc


@dataclass
class Host:
    """One test host: a network namespace with its own hostname and address(es).

    Attributes:
        name: its hostname inside its UTS namespace, and its name in the test's /etc/hosts.
        netns: the network namespace's name (unique per test run).
        addr: its IPv4 address on the first test link (``eth0``).
        addrs: one address per link (``eth0``, ``eth1``, ...); ``addrs[0] == addr``.
    """

    name: str
    netns: str
    addr: str
    addrs: list[str] = field(default_factory=list)
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` wrapped so it runs inside this host (its namespace and hostname)."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--",
                "env", f"HVT_HOSTNAME={self.name}", "sh", "-c", _SET_HOSTNAME, "sh", *argv]

    def popen(self, argv: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` on this host. ``env`` replaces the environment (None: inherit ours).

        Other keyword arguments go to :class:`subprocess.Popen`. The process is killed at teardown.
        """
        proc = subprocess.Popen(self.argv(argv), env=env, **kw)
        self._procs.append(proc)
        return proc

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 60.0,
            **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to completion; output captured as text unless ``kw`` says else.

        Raises:
            subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds (it is killed first).
        """
        capture = kw.pop("capture_output", "stdout" not in kw and "stderr" not in kw)
        kw.setdefault("text", True)
        if capture:
            kw.setdefault("stdout", subprocess.PIPE)
            kw.setdefault("stderr", subprocess.PIPE)
        popen = self.popen(argv, env=env, **kw)
        try:
            out, err = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.communicate()
            raise
        return subprocess.CompletedProcess(popen.args, popen.returncode, out, err)

    def pids(self) -> list[int]:
        """Every process now in this host's network namespace."""
        return _netns_pids(self.netns)


def _netns_pids(netns: str) -> list[int]:
    proc = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in proc.stdout.split()]


def _kill_netns(netns: str, procs: list[subprocess.Popen], timeout_seconds: float = 10.0) -> None:
    """SIGKILL every process in ``netns`` (until none is left) and reap our own children."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        pids = _netns_pids(netns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
        if not pids or time.monotonic() > deadline:
            return
        time.sleep(0.05)


@dataclass
class Cluster:
    """The hosts of one test and the switch namespace that joins them.

    Attributes:
        hosts: ``h1..hN`` in order.
        switch: the switch namespace's name (holds one bridge per link and every veth peer).
        subnets: one ``10.a.b.0/24`` per link.
    """

    hosts: list[Host]
    switch: str
    subnets: list[str]

    def host(self, name: str) -> Host:
        """The host named ``name``. Raises KeyError naming the hosts there are."""
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r}; hosts: {[h.name for h in self.hosts]}")

    def _peer(self, host: Host, link: int) -> str:
        return f"p{self.hosts.index(host) + 1}l{link}"

    def cut(self, host: Host, link: int = 0) -> None:
        """Take ``host``'s link down at the switch: its packets go nowhere (a partition, no RST)."""
        _ip("-n", self.switch, "link", "set", self._peer(host, link), "down")

    def heal(self, host: Host, link: int = 0) -> None:
        """Bring ``host``'s link back up at the switch."""
        _ip("-n", self.switch, "link", "set", self._peer(host, link), "up")

    def kill_host(self, host: Host) -> None:
        """SIGKILL every process in ``host``'s namespace (as if the machine died)."""
        _kill_netns(host.netns, host._procs)

    def pids(self) -> dict[str, list[int]]:
        """The processes now in each host's namespace, by host name."""
        return {h.name: h.pids() for h in self.hosts}


_SKIP: list[str | None] = []


def skip_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``/``unshare``, no permission), or None."""
    if _SKIP:
        return _SKIP[0]
    reason: str | None = None
    if os.geteuid() != 0:
        reason = "multi-host tests need root (network namespaces); run as root or in CI"
    else:
        missing = [t for t in ("ip", "unshare") if shutil.which(t) is None]
        if missing:
            reason = f"multi-host tests need {' and '.join(missing)} (Debian: iproute2, util-linux)"
    if reason is None:
        probe = f"hvtprobe{os.getpid()}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            reason = f"cannot create a network namespace here: {made.stderr.strip()}"
        else:
            ok = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "true"],
                                capture_output=True, text=True, timeout=30)
            if ok.returncode != 0:
                reason = f"cannot create a UTS namespace here: {ok.stderr.strip()}"
            _ip("netns", "del", probe, check=False)
    _SKIP.append(reason)
    return reason


def _hosts_file(hosts: list[Host]) -> str:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{h.addr}\t{h.name}" for h in hosts]
    return "\n".join(lines) + "\n"


def _nsswitch() -> str:
    """This machine's nsswitch.conf with names looked up in files only (no DNS: nothing to reach)."""
    try:
        lines = Path("/etc/nsswitch.conf").read_text().splitlines()
    except OSError:
        lines = []
    kept = [line for line in lines if line.split(":", 1)[0].strip() not in ("hosts", "networks")]
    return "\n".join([*kept, "hosts: files", "networks: files"]) + "\n"


def _random_subnets(links: int) -> list[str]:
    picked: list[str] = []
    while len(picked) < links:
        net = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        if net not in picked:
            picked.append(net)
    return picked


def _build(c: Cluster, links: int, hostnames: list[str] | None) -> None:
    _ip("netns", "add", c.switch)
    _ip("-n", c.switch, "link", "set", "lo", "up")
    for link in range(links):
        _ip("-n", c.switch, "link", "add", f"br{link}", "type", "bridge")
        _ip("-n", c.switch, "link", "set", f"br{link}", "up")
    for host in c.hosts:
        _ip("netns", "add", host.netns)
        _ip("-n", host.netns, "link", "set", "lo", "up")
        for link in range(links):
            peer, dev = c._peer(host, link), f"eth{link}"
            _ip("-n", c.switch, "link", "add", peer, "type", "veth", "peer", "name", dev,
                "netns", host.netns)
            _ip("-n", c.switch, "link", "set", peer, "master", f"br{link}")
            _ip("-n", c.switch, "link", "set", peer, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.addrs[link]}/24", "dev", dev)
            _ip("-n", host.netns, "link", "set", dev, "up")
    entries = c.hosts if hostnames is None else []
    for host in c.hosts:
        folder = ETC_NETNS / host.netns
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(_hosts_file(entries))
        (folder / "nsswitch.conf").write_text(_nsswitch())


def _teardown(c: Cluster) -> list[str]:
    """Kill, delete, remove; returns what could not be cleaned (empty when all went)."""
    problems: list[str] = []
    for host in c.hosts:
        _kill_netns(host.netns, host._procs)
    _kill_netns(c.switch, [])
    for netns in [h.netns for h in c.hosts] + [c.switch]:
        left = _netns_pids(netns)
        if left:
            problems.append(f"{netns}: processes {left} survived SIGKILL")
        _ip("netns", "del", netns, check=False)
        shutil.rmtree(ETC_NETNS / netns, ignore_errors=True)
    return problems


@contextlib.contextmanager
def cluster(n: int, *, links: int = 1, hostnames: list[str] | None = None) -> Iterator[Cluster]:
    """``n`` hosts ``h1..hn`` joined by ``links`` switched links; always torn down afterwards.

    Args:
        n: number of hosts (1..200).
        links: interfaces per host (``eth0``, ``eth1``, ...), each on its own subnet and bridge.
        hostnames: give the hosts these hostnames instead of ``h1..hn`` (e.g. the same name twice
            to test hostname pitfalls); then the test's /etc/hosts lists only localhost.

    Raises:
        NetnsError: a namespace, link or address could not be made (everything made is removed).
    """
    if not 1 <= n <= 200 or links < 1:
        raise ValueError(f"cluster(n={n}, links={links}): need 1 <= n <= 200 and links >= 1")
    if hostnames is not None and len(hostnames) != n:
        raise ValueError(f"hostnames={hostnames} must name all {n} hosts")
    suffix = f"{random.getrandbits(24):06x}"
    subnets = _random_subnets(links)
    hosts = [
        Host(name=(hostnames[k - 1] if hostnames else f"h{k}"), netns=f"hvt{suffix}h{k}",
             addr=f"{subnets[0]}.{10 + k}", addrs=[f"{net}.{10 + k}" for net in subnets])
        for k in range(1, n + 1)
    ]
    c = Cluster(hosts=hosts, switch=f"hvt{suffix}sw", subnets=[f"{net}.0/24" for net in subnets])
    try:
        _build(c, links, hostnames)
        yield c
    finally:
        _teardown(c)

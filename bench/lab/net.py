"""The lab's network: namespace hosts whose links are shaped with ``tc``, and what the wire carries.

Every host ``hK`` of a :func:`tests.multihost.netns.cluster` has one veth (``eth0``) whose peer
``pKl0`` sits on the switch namespace's bridge. :func:`shape` puts the same qdisc on both ends:
egress of ``eth0`` limits what the host sends, egress of ``pKl0`` what it receives, so each host
has a full-duplex port of ``rate`` like a switched Ethernet port. Traffic between processes of one
host stays on its loopback (unshaped), as between the GPUs of one machine.

The physical limit is measured, not assumed: :func:`measure_link` runs ``iperf3`` (one TCP
stream, ``seconds`` long) from ``h2`` to ``h1`` and reads both its payload goodput and what the
sender's interface counters moved in the same interval (``wire`` bytes: TCP/IP and Ethernet
headers included). A workload's bytes are read from the same counters, so a workload's time on
the wire is ``bytes / wire_bytes_per_s`` with both sides counted the same way.

Rates are ``tc`` rate strings: ``20mbit``, ``100mbit``, ``1gbit``; ``unshaped`` puts no qdisc.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

from tests.multihost.netns import Cluster, Host, NetnsError

__all__ = ["LinkMeasure", "UNSHAPED", "interface_bytes", "measure_link", "parse_rate", "shape", "skip_reason"]

UNSHAPED = "unshaped"
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(rate: str) -> float | None:
    """``"20mbit"`` -> 20e6 bits per second; ``"unshaped"`` -> None.

    Raises:
        ValueError: not ``<number><bit|kbit|mbit|gbit|tbit>`` or ``unshaped``.
    """
    if rate == UNSHAPED:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?bit)", rate.strip().lower())
    if not m:
        raise ValueError(f"link rate {rate!r}: expected e.g. 20mbit, 100mbit, 1gbit or {UNSHAPED!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def skip_reason() -> str | None:
    """Why the lab cannot run here (not root, no namespaces, no tc or iperf3), or None."""
    from tests.multihost.netns import skip_reason as netns_reason

    reason = netns_reason()
    if reason is not None:
        return reason
    missing = [t for t in ("tc", "iperf3") if shutil.which(t) is None]
    if missing:
        return f"the lab needs {' and '.join(missing)} (Debian: iproute2, iperf3)"
    return None


def _tc(netns: str, *args: str) -> None:
    proc = subprocess.run(["ip", "netns", "exec", netns, "tc", *args], capture_output=True, text=True,
                          timeout=30)
    if proc.returncode != 0:
        raise NetnsError(f"tc {' '.join(args)} in {netns} failed: {proc.stderr.strip()}")


def _qdisc_args(dev: str, bits_per_s: float, qdisc: str) -> list[list[str]]:
    rate = f"{int(bits_per_s)}bit"
    if qdisc == "htb":
        return [["qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
                ["class", "replace", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", rate,
                 "ceil", rate]]
    # burst: at least 64 KiB (a GSO super-packet must fit) or 4 ms at the rate; queue: 50 ms.
    burst = max(64 * 1024, int(bits_per_s / 8 * 0.004))
    return [["qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
             "latency", "50ms"]]


def shape(c: Cluster, rate: str, qdisc: str = "tbf") -> None:
    """Limit every host's port to ``rate`` each way (``unshaped``: remove any limit).

    Raises:
        ValueError: a bad ``rate`` or ``qdisc`` (``tbf`` or ``htb``).
        NetnsError: ``tc`` refused (the message has its stderr).
    """
    if qdisc not in ("tbf", "htb"):
        raise ValueError(f"qdisc={qdisc!r}: expected 'tbf' or 'htb'")
    bits = parse_rate(rate)
    for host in c.hosts:
        for netns, dev in ((host.netns, "eth0"), (c.switch, c._peer(host, 0))):
            if bits is None:
                subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root"],
                               capture_output=True, timeout=30)
                continue
            for args in _qdisc_args(dev, bits, qdisc):
                _tc(netns, *args)


def interface_bytes(host: Host, dev: str = "eth0") -> tuple[int, int]:
    """``(tx_bytes, rx_bytes)`` of ``dev`` in ``host``'s namespace (link-layer bytes)."""
    out = subprocess.run(["ip", "-n", host.netns, "-s", "-j", "link", "show", dev], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    stats = json.loads(out)[0]["stats64"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


@dataclass(frozen=True)
class LinkMeasure:
    """What one TCP stream carried between two lab hosts.

    Attributes:
        goodput_bytes_per_s: iperf3's received payload per second.
        wire_bytes_per_s: the sender's interface bytes per second over the same interval
            (payload plus TCP/IP/Ethernet headers and retransmissions).
        seconds: the measured interval.
    """

    goodput_bytes_per_s: float
    wire_bytes_per_s: float
    seconds: float


def measure_link(c: Cluster, seconds: float = 3.0, port: int = 5201) -> LinkMeasure:
    """One iperf3 TCP stream from ``h2`` to ``h1`` for ``seconds`` (plus iperf3's own start).

    Raises:
        RuntimeError: iperf3 failed (its output is in the message).
    """
    server, client = c.hosts[0], c.hosts[1]
    srv = server.popen(["iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        tx0, _ = interface_bytes(client)
        proc = client.run(["iperf3", "-c", server.addr, "-p", str(port), "-t", str(seconds), "-J"],
                          timeout=seconds + 30)
        tx1, _ = interface_bytes(client)
    finally:
        srv.kill()
        srv.wait()
    if proc.returncode != 0:
        tail = proc.stdout[-2000:] + proc.stderr[-2000:]
        raise RuntimeError(f"iperf3 failed (rc={proc.returncode}):\n{tail}")
    end = json.loads(proc.stdout)["end"]
    measured = float(end["sum_received"]["seconds"])
    goodput = float(end["sum_received"]["bytes"]) / measured
    # Headers and retransmissions: the sender's interface moved ``overhead`` bytes per payload byte
    # delivered (iperf3's sum_sent also counts what still sat in the socket buffer at its end).
    overhead = (tx1 - tx0) / float(end["sum_received"]["bytes"])
    return LinkMeasure(goodput, goodput * overhead, measured)

"""Host lists for hvdrun: ``-H host1:2,host2:2`` and hostfiles (``host slots=N`` lines)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hvd_trainer.launch.errors import HvdrunError

__all__ = ["HostSlots", "parse_hosts", "read_hostfile", "assign_processes"]

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True, slots=True)
class HostSlots:
    """One host and how many processes it may run."""

    host: str
    slots: int

    @property
    def is_local(self) -> bool:
        """Whether the host is this machine's loopback name."""
        return self.host in LOCAL_NAMES


def _host(host: str, slots: int, origin: str) -> HostSlots:
    if not host or slots < 1:
        raise HvdrunError(
            f"bad host entry {origin!r}: expected a host name and slots >= 1. "
            "HINT: -H host1:2,host2:2 or a hostfile line 'host1 slots=2'."
        )
    return HostSlots(host=host, slots=slots)


def parse_hosts(spec: str) -> list[HostSlots]:
    """Parse ``"h1:2,h2:2"`` (``"h1"`` alone means one slot).

    Raises:
        HvdrunError: an empty entry, a non-integer slot count, a count < 1 or a repeated host.
    """
    hosts: list[HostSlots] = []
    for item in spec.split(","):
        name, _, slots = item.strip().rpartition(":") if ":" in item else (item.strip(), "", "1")
        if not slots.strip().isdigit():
            raise HvdrunError(f"bad slot count in -H entry {item!r}. HINT: -H host1:2,host2:2")
        hosts.append(_host(name.strip(), int(slots), item))
    return _unique(hosts)


_HOSTFILE_LINE = re.compile(r"^(\S+)(?:\s+slots\s*=\s*(\d+))?\s*$")


def read_hostfile(path: str | Path) -> list[HostSlots]:
    """Read ``host slots=N`` lines (``#`` comments and blank lines ignored; no slots = 1).

    Raises:
        HvdrunError: the file is missing or a line does not match ``host [slots=N]``.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise HvdrunError(f"cannot read hostfile {str(path)!r}: {exc.strerror}.") from exc
    hosts: list[HostSlots] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOSTFILE_LINE.match(line)
        if match is None:
            raise HvdrunError(
                f"hostfile {str(path)!r} line {number}: {raw!r} is not 'host slots=N'."
            )
        hosts.append(_host(match.group(1), int(match.group(2) or 1), raw))
    if not hosts:
        raise HvdrunError(f"hostfile {str(path)!r} lists no hosts.")
    return _unique(hosts)


def _unique(hosts: list[HostSlots]) -> list[HostSlots]:
    seen = [h.host for h in hosts]
    dupes = sorted({h for h in seen if seen.count(h) > 1})
    if dupes:
        raise HvdrunError(f"hosts {dupes} are listed more than once. HINT: give each host once.")
    return hosts


def assign_processes(hosts: list[HostSlots], num_proc: int) -> list[HostSlots]:
    """Fill hosts in order, like Horovod; return the hosts used with their process counts.

    Raises:
        HvdrunError: ``num_proc`` exceeds the total slots.
    """
    total = sum(h.slots for h in hosts)
    if num_proc > total:
        raise HvdrunError(
            f"-np {num_proc} is more than the {total} slot(s) of hosts "
            f"{','.join(f'{h.host}:{h.slots}' for h in hosts)}. HINT: lower -np or add slots."
        )
    used: list[HostSlots] = []
    left = num_proc
    for host in hosts:
        if left == 0:
            break
        take = min(host.slots, left)
        used.append(HostSlots(host=host.host, slots=take))
        left -= take
    return used

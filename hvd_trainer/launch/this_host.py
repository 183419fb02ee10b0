"""Which ``-H`` entry is this machine, and which address other hosts reach it on.

torchrun's c10d rendezvous decides whether an agent hosts the rendezvous store by comparing the
endpoint's name with ``socket.gethostname()`` and its resolved addresses; when machines share a
hostname (containers, namespaces, cloned images) or a name resolves elsewhere, no agent hosts it
and every agent waits 60 s for a C++ ``DistNetworkError``. hvdrun decides it here instead: a host
entry is this machine when it is a loopback name, this machine's hostname, or resolves to an
address a socket on this machine can bind (an address of one of its interfaces). hvdrun then tells
each agent whether it is the host (c10d's ``is_host``) and which address to announce.
"""

from __future__ import annotations

import fcntl
import socket
import struct

from hvd_trainer.launch.errors import HvdrunError
from hvd_trainer.launch.hosts import LOCAL_NAMES, HostSlots

__all__ = ["resolve", "is_local_address", "is_this_host", "find_this_host", "interface_address"]

_SIOCGIFADDR = 0x8915


def resolve(name: str) -> list[str]:
    """The IPv4 addresses ``name`` resolves to here (empty when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return sorted({info[4][0] for info in infos})


def is_local_address(addr: str) -> bool:
    """Whether ``addr`` belongs to an interface of this machine (a socket can bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError:
            return False
    return True


def is_this_host(name: str) -> bool:
    """Whether the ``-H`` entry ``name`` is this machine (loopback name, own hostname, own address)."""
    if name in LOCAL_NAMES or name == socket.gethostname():
        return True
    return any(is_local_address(addr) for addr in resolve(name))


def find_this_host(hosts: list[HostSlots]) -> int | None:
    """Index of the first entry of ``hosts`` that is this machine, or ``None``."""
    for index, host in enumerate(hosts):
        if is_this_host(host.host):
            return index
    return None


def interface_address(ifname: str) -> str:
    """The IPv4 address of network interface ``ifname`` on this machine.

    Raises:
        HvdrunError: there is no such interface or it has no IPv4 address (lists the interfaces).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            names = ", ".join(name for _, name in socket.if_nameindex())
            raise HvdrunError(
                f"--network-interface {ifname}: this host ({socket.gethostname()}) has no interface "
                f"{ifname!r} with an IPv4 address; it has: {names}. HINT: name one of those."
            ) from None
    return socket.inet_ntoa(packed[20:24])

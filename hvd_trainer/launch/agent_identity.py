"""Which ``-H`` host a torchrun agent runs on, decided before it starts (several hosts only).

The answer sets the agent's c10d ``is_host`` (the first host's agent hosts the rendezvous store)
and the address it announces to the others (``--local-addr``: the ``--network-interface``'s
address, else its ``-H`` name). Mistakes that would otherwise cost torchrun's 60-s rendezvous
timeout and a C++ traceback are one-line errors here (:class:`HvdrunError`, raised at once):

* this machine is none of the hosts (same-line mode run on a machine not in ``-H``);
* this machine is the first host only by hostname, and that name does not resolve to an address
  of this machine (hosts sharing one hostname, a stale ``/etc/hosts``): the others could not
  reach its rendezvous;
* the first host's name does not resolve here.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from hvd_trainer.launch.errors import HvdrunError
from hvd_trainer.launch.hosts import LOCAL_NAMES, HostSlots
from hvd_trainer.launch.this_host import find_this_host, interface_address, is_local_address, resolve

__all__ = ["AgentIdentity", "identify", "interface_env", "local_addresses"]


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    """The host an agent runs on: its position in ``-H`` (0 = the rendezvous host) and the
    address it announces."""

    index: int
    """Position in ``-H`` (0: the rendezvous host; -1: an elastic host not listed in ``-H``)."""
    host: str
    address: str


def _interfaces() -> dict[str, str]:
    """``{interface: IPv4 address}`` of this machine's non-loopback interfaces that have one."""
    found = {}
    for _, name in socket.if_nameindex():
        try:
            addr = interface_address(name)
        except HvdrunError:
            continue
        if not addr.startswith("127."):
            found[name] = addr
    return found


def local_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses, by interface name (for messages)."""
    return [f"{addr} ({name})" for name, addr in _interfaces().items()]


def interface_env(agent: AgentIdentity, environ: dict[str, str] | None = None) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` = the interface of this host's ``-H`` address,
    when this machine's hostname does not resolve to one of its own non-loopback addresses.

    gloo announces the address its hostname resolves to, and falls back to 127.0.0.1, which the
    other hosts cannot reach (hosts sharing a hostname, a hostname missing from DNS). Nothing is
    set when the user chose (``--network-interface``, those variables) or the hostname is fine.
    """
    environ = dict(environ) if environ is not None else {}
    if "GLOO_SOCKET_IFNAME" in environ:
        return {}
    if any(is_local_address(a) and not a.startswith("127.") for a in resolve(socket.gethostname())):
        return {}
    wanted = {a for a in resolve(agent.address) if is_local_address(a)}
    for name, addr in _interfaces().items():
        if addr in wanted:
            return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": environ.get("NCCL_SOCKET_IFNAME", name)}
    return {}


def _check_rendezvous_host(hosts: list[HostSlots], index: int) -> None:
    first = hosts[0].host
    if index == 0:
        if first in LOCAL_NAMES or first != socket.gethostname():
            return  # recognised by a local address (or loopback): it is reachable as given
        addrs = resolve(first)
        if any(is_local_address(a) for a in addrs):
            return
        seen = f"resolves to {', '.join(addrs)}" if addrs else "does not resolve"
        mine = ", ".join(local_addresses()) or "none"
        raise HvdrunError(
            f"this host is named {first!r}, the first host of -H (the rendezvous host), but {first!r} "
            f"{seen} here, which is no address of this machine, so the other hosts cannot reach its "
            f"rendezvous. HINT: put this machine's address first in -H (its addresses: {mine}), or "
            f"map {first!r} to it in /etc/hosts and give every host its own hostname."
        )
    try:
        socket.inet_aton(first)
    except OSError:
        if not resolve(first):
            raise HvdrunError(
                f"the rendezvous host {first!r} (first in -H) does not resolve on this host "
                f"({socket.gethostname()}). HINT: use its IP address in -H, or add it to /etc/hosts."
            ) from None


def identify(hosts: list[HostSlots], this_host: str | None, network_interface: str | None,
             elastic: bool = False) -> AgentIdentity:
    """The identity of the agent started here for ``hosts`` (``this_host``: given by the launching
    hvdrun over ssh, else detected). ``elastic``: a machine not in ``hosts`` may join (as a host
    that does not host the rendezvous, announcing its hostname).

    Raises:
        HvdrunError: this machine is none of ``hosts`` (and the job is not elastic), is the first
            host only by a hostname that does not resolve to it, the first host does not resolve,
            or ``network_interface`` does not exist here.
    """
    names = [h.host for h in hosts]
    index = names.index(this_host) if this_host is not None else find_this_host(hosts)
    if index is None and elastic:
        _check_rendezvous_host(hosts, -1)
        address = socket.gethostname() if network_interface is None else interface_address(network_interface)
        return AgentIdentity(index=-1, host=socket.gethostname(), address=address)
    if index is None:
        mine = ", ".join(local_addresses()) or "none"
        raise HvdrunError(
            f"this machine ({socket.gethostname()}, addresses {mine}) is none of the hosts "
            f"{','.join(names)}: run this same-line command on the hosts of -H only, or drop --no-ssh "
            "and run it once, on the first host. HINT: -H entries must be names or addresses of the hosts."
        )
    _check_rendezvous_host(hosts, index)
    entry = names[index]
    if network_interface is not None:
        address = interface_address(network_interface)
    elif entry in LOCAL_NAMES:
        address = socket.gethostname()
    else:
        address = entry
    return AgentIdentity(index=index, host=entry, address=address)

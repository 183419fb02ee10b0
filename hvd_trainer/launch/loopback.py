"""Loopback-only rendezvous store for single-host torchrun runs started by hvdrun.

torchrun's static rendezvous binds its TCPStore on every interface (``*:port``) even with
``--master-addr=127.0.0.1``. On one host nothing outside the machine needs to reach it, so
hvdrun, which runs torchrun in-process, swaps in this backend: the same static rendezvous,
with the store listening on a socket bound to ``127.0.0.1`` only (``TCPStore``'s
``master_listen_fd``). The workers' gloo sockets already bind to the loopback address they
reach the master on. The printed ``--dry-run`` command is the plain torchrun equivalent.
"""

from __future__ import annotations

import argparse
import socket
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

__all__ = ["BACKEND", "use_loopback_store"]

BACKEND = "hvdrun-loopback"
LOOPBACK = "127.0.0.1"


class LoopbackStaticRendezvous(RendezvousHandler):
    """torchrun's static rendezvous of one node (what ``StaticTCPRendezvous`` does for rank 0),
    on the public handler interface, over a store that listens on the bound socket ``sock``."""

    def __init__(self, port: int, world_size: int, run_id: str, timeout: timedelta,
                 sock: socket.socket) -> None:
        self.port, self.world_size, self.run_id = port, world_size, run_id
        self.store = TCPStore(LOOPBACK, port, world_size, True, timeout, multi_tenant=True,
                              master_listen_fd=sock.fileno())
        self._socket = sock  # keep the listening socket alive with the store

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers use the agent's store, as with the static rendezvous

    def next_rendezvous(self) -> RendezvousInfo:
        return RendezvousInfo(PrefixStore(self.run_id, self.store), 0, self.world_size,
                              RendezvousStoreInfo(LOOPBACK, self.port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    _, port = parse_rendezvous_endpoint(params.endpoint, -1)
    timeout = timedelta(seconds=int(params.config.get("timeout", 600)))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(
            f"cannot bind the rendezvous store to {LOOPBACK}:{port}: {exc.strerror}. "
            "HINT: choose another --port or leave it out to pick a free one."
        ) from exc
    sock.listen(128)
    return LoopbackStaticRendezvous(port, params.max_nodes, params.run_id, timeout, sock)


def _register() -> None:
    rendezvous_handler_registry.register(BACKEND, _create_handler)


def use_loopback_store(args: argparse.Namespace) -> bool:
    """Switch parsed torchrun ``args`` to the loopback store when they describe a single-host
    static rendezvous on 127.0.0.1; return whether they were switched."""
    single_static = (
        args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_addr == LOOPBACK
        and args.nnodes == "1" and args.master_port is not None
    )
    if not single_static:
        return False
    _register()
    args.rdzv_backend = BACKEND
    args.rdzv_endpoint = f"{LOOPBACK}:{args.master_port}"
    return True

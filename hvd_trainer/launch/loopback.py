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

__all__ = ["BACKEND", "use_loopback_store"]

BACKEND = "hvdrun-loopback"
LOOPBACK = "127.0.0.1"


def _create_handler(params):  # RendezvousParameters -> RendezvousHandler
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class LoopbackStaticRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return BACKEND

    _, port = parse_rendezvous_endpoint(params.endpoint, -1)
    timeout = int(params.config.get("timeout", 600))
    handler = LoopbackStaticRendezvous(LOOPBACK, port, 0, params.max_nodes, params.run_id, timeout)
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
    handler._store = TCPStore(
        LOOPBACK, port, handler.world_size, True, handler.timeout,
        multi_tenant=True, master_listen_fd=sock.fileno(),
    )
    handler._hvdrun_socket = sock  # keep the listening socket alive with the store
    return handler


def _register() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

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

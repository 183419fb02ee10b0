"""torchrun's c10d rendezvous behind a door that only the job's own agents pass.

torch's c10d rendezvous keeps its state in a ``TCPStore`` that answers whoever reaches the port:
a second copy of the launch line, or one with another secret, joins the rendezvous and waits in
it (or, in an elastic job, makes the agents restart their workers). hvdrun's agents use this
backend instead (``hvdrun-c10d``): torch's own :class:`DynamicRendezvousHandler`, over the same
kind of store, with three additions.

* **Admission.** The agent that hosts the store publishes a fresh nonce and
  ``HMAC-SHA256(secret, "hvdrun-rdzv|<run id>|<nonce>")`` (an empty key when the job has no
  secret). Every other agent computes the same tag with its own secret and run id before it
  reads or writes anything else; a mismatch (another ``HOROVOD_SECRET_KEY``, or another command
  line or ``--rdzv-id`` on the same port) raises :class:`RendezvousRefusedError` in that agent,
  which leaves without touching the job.
* **A full job says so.** A job that takes no spares (not elastic) whose rendezvous is complete
  with every host alive refuses a further agent at once (a second copy of the same line),
  instead of letting it wait in torch's redundancy list until the job ends. An elastic job lets
  it wait: a spare host, as in Horovod's elastic mode.
* **Signed state.** The rendezvous state lives under a key derived from the secret, and every
  write of it carries ``HMAC-SHA256(secret, state)``; a state that does not verify is never
  unpickled (:class:`RendezvousStateError`).

The workers prove the secret again at init (:mod:`hvd_trainer.comm.world.membership`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import itertools
import pickle
import secrets
import socket
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import Token, create_handler
from torch.distributed.elastic.rendezvous.utils import (
    _matches_machine_hostname,
    parse_rendezvous_endpoint,
)

from hvd_trainer.launch.errors import RendezvousRefusedError

__all__ = ["BACKEND", "admission_tag", "use_guarded_rendezvous", "SignedC10dBackend"]

BACKEND = "hvdrun-c10d"
NONCE_KEY = "hvdrun/door/nonce"
TAG_KEY = "hvdrun/door/tag"
LOOPBACK = "127.0.0.1"
MAC_BYTES = 32  # SHA-256
_REGISTERED = itertools.count()


def admission_tag(secret: str | None, run_id: str, nonce: str) -> str:
    """Hex ``HMAC-SHA256(secret, "hvdrun-rdzv|<run_id>|<nonce>")`` (64 characters); a job
    without a secret uses the empty key."""
    return hmac.new((secret or "").encode(), f"hvdrun-rdzv|{run_id}|{nonce}".encode(),
                    hashlib.sha256).hexdigest()


def _namespace(secret: str | None, run_id: str) -> str:
    """The store prefix of the job's rendezvous keys: not computable without the secret."""
    mac = hmac.new((secret or "").encode(), f"hvdrun-ns|{run_id}".encode(), hashlib.sha256)
    return f"hvdrun/{mac.hexdigest()[:32]}/"


class SignedC10dBackend(C10dRendezvousBackend):
    """torch's c10d backend whose state bytes carry ``HMAC-SHA256(key, state)`` in front.

    ``get_state``/``set_state`` take and return the bare state; a stored state whose MAC does
    not verify raises :class:`RendezvousStateError` before anything unpickles it.
    """

    def __init__(self, store: Store, run_id: str, *, key: bytes, name: str = BACKEND) -> None:
        self._mac_key, self._name = key, name
        super().__init__(store, run_id)

    @property
    def name(self) -> str:
        return self._name  # the name torchrun asked for (it checks the handler's)

    def _sign(self, state: bytes) -> bytes:
        return hmac.new(self._mac_key, state, hashlib.sha256).digest() + state

    def _verified(self, signed: bytes) -> bytes:
        mac, state = signed[:MAC_BYTES], signed[MAC_BYTES:]
        if len(signed) < MAC_BYTES or not hmac.compare_digest(
                mac, hmac.new(self._mac_key, state, hashlib.sha256).digest()):
            raise RendezvousStateError(
                "the rendezvous state in the store was not written with this job's secret "
                "(HOROVOD_SECRET_KEY): something outside the job wrote it, so it is not read. "
                "HINT: keep the rendezvous port reachable only from the job's hosts."
            )
        return state

    def get_state(self) -> tuple[bytes, Token] | None:
        result = super().get_state()
        if result is None:
            return None
        return self._verified(result[0]), result[1]

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        result = super().set_state(self._sign(state), token)
        if result is None:
            return None
        stored, new_token, written = result
        return self._verified(stored), new_token, written


def _serve(host: str, port: int, timeout: timedelta) -> tuple[TCPStore, socket.socket | None]:
    """A store server on ``port``: bound to loopback only when the endpoint is the loopback
    address (a single-host job with restarts), else on every interface as torch does."""
    if host != LOOPBACK:
        return TCPStore(host, port, is_master=True, multi_tenant=True, timeout=timeout), None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, port))
        sock.listen(128)
        return TCPStore(host, port, is_master=True, multi_tenant=True, timeout=timeout,
                        master_listen_fd=sock.fileno()), sock
    except (OSError, RuntimeError, ValueError):
        sock.close()
        raise


def _store(params: RendezvousParameters, hosting: bool) -> tuple[TCPStore, bool, socket.socket | None]:
    """The rendezvous ``TCPStore``, whether this agent serves it, and the listening socket to
    keep open with it. An agent meant to host whose port is taken (another agent of the same
    line on this host) connects as a client, and the door decides."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    if hosting:
        try:
            store, sock = _serve(host, port, timeout)
            return store, True, sock
        except (OSError, RuntimeError, ValueError):
            pass  # the port is in use: whoever holds it answers the door below
    return TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout), False, None


def _knock(store: Store, *, secret: str | None, run_id: str, endpoint: str) -> None:
    """As a joining agent: check the host's tag; raise :class:`RendezvousRefusedError` when it
    was made with another secret or run id."""
    nonce = store.get(NONCE_KEY).decode()
    theirs = store.get(TAG_KEY).decode()
    if not hmac.compare_digest(theirs, admission_tag(secret, run_id, nonce)):
        raise RendezvousRefusedError(
            f"the job whose rendezvous is at {endpoint} holds another secret (HOROVOD_SECRET_KEY) "
            f"or was started from another command line (rendezvous id {run_id!r} here), so this "
            "hvdrun was not let in; the job was not touched. HINT: run exactly the job's hvdrun "
            "line with the job's HOROVOD_SECRET_KEY exported on every host, or pick another --port "
            "for a separate job."
        )


def _alive(state: Any, node: Any, now: datetime, dead_after: timedelta) -> bool:
    beat = state.last_heartbeats.get(node)
    return beat is not None and now - beat < dead_after


def _refuse_if_full(backend: SignedC10dBackend, params: RendezvousParameters, endpoint: str) -> None:
    """As a joining agent of a job without spares: refuse when its rendezvous is complete and
    every participant is alive (a later agent could only wait until the job ends)."""
    found = backend.get_state()
    if found is None:
        return
    state = pickle.loads(found[0])  # verified: written with the job's secret
    interval = params.get_as_int("keep_alive_interval", 5) or 5
    dead_after = timedelta(seconds=interval * (params.get_as_int("keep_alive_max_attempt", 3) or 3))
    now = datetime.now(timezone.utc)
    participants = getattr(state, "participants", {})
    if (getattr(state, "complete", False) and not getattr(state, "closed", False)
            and len(participants) >= params.max_nodes
            and all(_alive(state, node, now, dead_after) for node in participants)):
        raise RendezvousRefusedError(
            f"the job whose rendezvous is at {endpoint} is already running with all its "
            f"{params.max_nodes} host(s), so this second copy of its hvdrun line was not let in; "
            "the job was not touched. HINT: wait for the job to end, or give a separate job "
            "another --port."
        )


def _create_handler(params: RendezvousParameters, *, secret: str | None,
                    spares: bool) -> RendezvousHandler:
    host, _ = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    wanted = params.get_as_bool("is_host")
    store, hosting, sock = _store(params, _matches_machine_hostname(host) if wanted is None else wanted)
    if hosting:
        nonce = secrets.token_hex(16)
        # written only where none is: a store this process already serves (torch's multi-tenant
        # TCPStore shares one server per port) keeps its first host's door
        hosting = store.compare_set(NONCE_KEY, "", nonce).decode() == nonce
        if hosting:
            store.set(TAG_KEY, admission_tag(secret, params.run_id, nonce))
    if not hosting:
        store.wait([TAG_KEY])  # the host sets it right after it starts listening
        _knock(store, secret=secret, run_id=params.run_id, endpoint=params.endpoint)
    job_store = PrefixStore(_namespace(secret, params.run_id), store)
    key = hmac.new((secret or "").encode(), f"hvdrun-state|{params.run_id}".encode(),
                   hashlib.sha256).digest()
    backend = SignedC10dBackend(job_store, params.run_id, key=key, name=params.backend)
    if not hosting and not spares:
        _refuse_if_full(backend, params, params.endpoint)
    handler = create_handler(job_store, backend, params)
    handler._hvdrun_listen_socket = sock  # type: ignore[attr-defined]  # open as long as the store
    return handler


def use_guarded_rendezvous(args: Any, secret: str | None, *, spares: bool) -> bool:
    """Switch parsed torchrun ``args`` from the c10d rendezvous to this one; return whether they
    were switched. ``secret``: the job's ``HOROVOD_SECRET_KEY`` (``None`` without one);
    ``spares``: whether an agent arriving at a full job waits as a spare (elastic jobs) instead
    of being refused."""
    if args.rdzv_backend != "c10d":
        return False
    name = f"{BACKEND}-{next(_REGISTERED)}"  # torch's registry keeps one creator per name
    rendezvous_handler_registry.register(name, functools.partial(_create_handler, secret=secret,
                                                                spares=spares))
    args.rdzv_backend = name
    return True

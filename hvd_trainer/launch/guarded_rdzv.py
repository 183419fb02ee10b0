"""torchrun's c10d rendezvous behind a door that only the job's own agents pass.

torch's c10d rendezvous keeps its state in a ``TCPStore`` that answers whoever reaches the port:
a second copy of the launch line, or one with another secret, joins the rendezvous and waits in
it (or, in an elastic job, makes the agents restart their workers). hvdrun's agents use this
backend instead (``hvdrun-c10d``): torch's own :class:`DynamicRendezvousHandler`, over the same
kind of store, with three additions.

* **Admission.** The agent that hosts the store writes an "open" mark under a key derived from
  the secret and run id (``HMAC-SHA256(secret, "hvdrun-ns|<run id>")``, the empty key without a
  secret), then a public "up" mark. Every other agent, before it reads or writes anything else
  of the job, looks for the open mark under the key its own secret and run id give: found, it is
  let in; absent while the host is up (another ``HOROVOD_SECRET_KEY``, or another command line or
  ``--rdzv-id`` on the same port), it raises :class:`RendezvousRefusedError` and leaves without
  touching the job. Whoever reaches the port can overwrite or delete the public mark, but cannot
  find the job's keys without the secret, so an agent of the job is never turned away by it.
  No host up within the start timeout: :class:`RendezvousUnreachableError`.
* **One agent per host.** An agent meant to host whose port is taken by an agent of the same
  job (a second copy of the line on the first host) is refused; in a job without spares every
  agent also claims its ``--local-addr`` once (``compare_set``), so a second copy on another
  host is refused even before the rendezvous completes.
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
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
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

from hvd_trainer.comm import pid_alive
from hvd_trainer.launch.errors import RendezvousEndedError, RendezvousRefusedError, RendezvousUnreachableError

__all__ = ["BACKEND", "DoorRecord", "Places", "use_guarded_rendezvous", "SignedC10dBackend"]

BACKEND = "hvdrun-c10d"
UP_KEY = "hvdrun/door/up"
ROUND_SIZE_KEY = "hvdrun/round_size"
"""A round's number of agents (torch's group world size), under the round's own key prefix."""
LOOPBACK = "127.0.0.1"
MAC_BYTES = 32  # SHA-256
KNOCK_POLL_SECONDS = 0.05
_REGISTERED = itertools.count()


@dataclass(slots=True)
class DoorRecord:
    """What one agent's guarded rendezvous went through, for hvdrun's last line."""

    endpoint: str = ""
    """The rendezvous ``host:port`` (empty until the handler is created)."""
    joined: bool = False
    """Whether this agent was ever given a place in a world (a spare that waited: no)."""
    handler: RendezvousHandler | None = None

    def saw_closed(self) -> bool:
        """Whether the last rendezvous state this agent read was closed (the job ended)."""
        holder = getattr(self.handler, "_state_holder", None)  # torch's, read only
        return bool(getattr(getattr(holder, "state", None), "closed", False))


def _namespace(secret: str | None, run_id: str) -> str:
    """The store prefix of the job's rendezvous keys: not computable without the secret."""
    mac = hmac.new((secret or "").encode(), f"hvdrun-ns|{run_id}".encode(), hashlib.sha256)
    return f"hvdrun/{mac.hexdigest()[:32]}/"


def _state_key(secret: str | None, run_id: str) -> bytes:
    """The HMAC key of the job's signed rendezvous state."""
    return hmac.new((secret or "").encode(), f"hvdrun-state|{run_id}".encode(), hashlib.sha256).digest()


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


def _store(params: RendezvousParameters, hosting: bool,
           deadline: float) -> tuple[TCPStore, bool, socket.socket | None]:
    """The rendezvous ``TCPStore``, whether this agent serves it, and the listening socket to
    keep open with it. An agent meant to host whose port is taken connects as a client, and the
    door decides. A client that reaches no store by ``deadline`` (``time.monotonic()``) raises
    :class:`RendezvousUnreachableError`."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    if hosting:
        try:
            store, sock = _serve(host, port, timeout)
            return store, True, sock
        except (OSError, RuntimeError, ValueError):
            pass  # the port is in use: whoever holds it answers the door below
    _await_listener(params, host, port, deadline)
    try:
        store = TCPStore(host, port, is_master=False, multi_tenant=True,
                         timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except (OSError, RuntimeError) as exc:  # DistNetworkError / DistStoreError: nobody answered
        raise _unreachable(params, f"no store answered ({type(exc).__name__})") from None
    store.set_timeout(timeout)
    return store, False, None


def _await_listener(params: RendezvousParameters, host: str, port: int, deadline: float) -> None:
    """Return once something accepts TCP connections at ``host:port``; raise
    :class:`RendezvousUnreachableError` at ``deadline`` (torch's store client retries for as
    long, but overshoots it and logs a C++ stack on the way)."""
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                why = exc.strerror or type(exc).__name__
                raise _unreachable(params, f"nothing answered ({why})") from None
        time.sleep(KNOCK_POLL_SECONDS * 4)


def _join_timeout(params: RendezvousParameters) -> float:
    """Seconds an agent waits for the rendezvous host (torch's ``join_timeout``: hvdrun's
    ``--start-timeout``)."""
    return float(params.get_as_int("join_timeout", 600) or 600)


def _unreachable(params: RendezvousParameters, what: str) -> RendezvousUnreachableError:
    host, _ = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    return RendezvousUnreachableError(
        f"no hvdrun of this job hosted its rendezvous at {params.endpoint} within the start "
        f"timeout of {_join_timeout(params):g} s: {what}. HINT: start the same hvdrun line on "
        f"{host} (the first -H host), check that this host reaches its --port, or raise "
        "--start-timeout."
    )


def _knock(store: Store, door_key: str, params: RendezvousParameters, deadline: float) -> None:
    """As a joining agent: return once the host's open mark is found under ``door_key``; raise
    :class:`RendezvousRefusedError` when the host is up without it (another secret or run id),
    :class:`RendezvousUnreachableError` when no host is up by ``deadline``."""
    while not store.check([door_key]):
        if store.check([UP_KEY]) and not store.check([door_key]):
            raise RendezvousRefusedError(
                f"the job whose rendezvous is at {params.endpoint} holds another secret "
                f"(HOROVOD_SECRET_KEY) or was started from another command line (rendezvous id "
                f"{params.run_id!r} here), so this hvdrun was not let in; the job was not touched. "
                "HINT: run exactly the job's hvdrun line with the job's HOROVOD_SECRET_KEY "
                "exported on every host, or pick another --port for a separate job."
            )
        if time.monotonic() >= deadline:
            raise _unreachable(params, "its store is up, but no agent of the job opened it (the port may "
                                       "be held by a job with another secret or command line)")
        time.sleep(KNOCK_POLL_SECONDS)  # the host writes its marks right after it listens


def _claim(store: Store, claim_key: str, params: RendezvousParameters) -> None:
    """As an agent of a job without spares: claim this host (``--local-addr``) once; a second
    agent claiming the same host is refused."""
    token = secrets.token_hex(16)
    if store.compare_set(claim_key, "", token).decode(errors="replace") != token:
        raise RendezvousRefusedError(
            f"another hvdrun of the job whose rendezvous is at {params.endpoint} already runs on "
            f"this host ({params.local_addr}), so this second copy of its line was not let in; "
            "the job was not touched. HINT: run the line once per host; give a separate job "
            "another --port."
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


def _create_handler(params: RendezvousParameters, *, secret: str | None, spares: bool,
                    record: DoorRecord | None = None) -> RendezvousHandler:
    host, _ = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    wanted = params.get_as_bool("is_host")
    meant_to_host = _matches_machine_hostname(host) if wanted is None else wanted
    deadline = time.monotonic() + _join_timeout(params)
    store, hosting, sock = _store(params, meant_to_host, deadline)
    prefix = _namespace(secret, params.run_id)
    if hosting:
        # a store this process already serves (torch's multi-tenant TCPStore shares one server
        # per port) keeps the marks of the jobs it holds
        store.set(prefix + "door", "open")
        store.set(UP_KEY, "1")
    else:
        _knock(store, prefix + "door", params, deadline)
        if meant_to_host:  # let in, so the port is held by an agent of this very job
            raise RendezvousRefusedError(
                f"another hvdrun of this job already hosts its rendezvous at {params.endpoint}, so "
                "this second copy of its line was not let in; the job was not touched. HINT: run "
                "the line once per host; give a separate job another --port."
            )
    job_store = PrefixStore(prefix, store)
    backend = SignedC10dBackend(job_store, params.run_id, key=_state_key(secret, params.run_id),
                                name=params.backend)
    if not hosting and not spares:
        _refuse_if_full(backend, params, params.endpoint)
    if not spares and params.local_addr:
        _claim(store, f"{prefix}claim/{params.local_addr}", params)
    handler = create_handler(job_store, backend, params)
    handler._hvdrun_listen_socket = sock  # type: ignore[attr-defined]  # open as long as the store
    record = DoorRecord() if record is None else record
    record.endpoint, record.handler = params.endpoint, handler
    rejoin = params.get_as_int("rejoin_timeout")
    places = Places(handler, params) if params.get_as_bool("in_process", False) else None
    handler.next_rendezvous = _noting_joins(handler, record, rejoin, places)  # type: ignore[method-assign]
    return handler


def _noting_joins(handler: RendezvousHandler, record: DoorRecord, rejoin_seconds: int | None,
                  places: Places | None = None) -> Any:
    """``handler.next_rendezvous`` that notes a join in ``record`` and, after the first one,
    lets the later rounds (re-forms) wait ``rejoin_seconds`` (torch has one join timeout for all).
    With ``places`` (an in-process job), an agent's first join takes a lost agent's place in the
    running round when there is one (see :class:`Places`) instead of opening a new round."""
    next_rendezvous = handler.next_rendezvous

    @functools.wraps(next_rendezvous)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            info = None if record.joined or places is None else places.take()
            if info is None:
                info = next_rendezvous(*args, **kwargs)
        except RendezvousGracefulExitError as exc:
            # torch's agent returns None for it, which its launcher then fails on
            # (AttributeError: 'NoneType' object has no attribute 'is_failed')
            raise RendezvousEndedError(f"the job's rendezvous at {record.endpoint} closed: {exc}") from None
        except RendezvousClosedError as exc:
            if record.joined:
                raise
            # a spare that waited for a place (Places) finds the job ended
            raise RendezvousEndedError(f"the job's rendezvous at {record.endpoint} closed: {exc}") from None
        if not record.joined and rejoin_seconds:
            timeout = getattr(getattr(handler, "_settings", None), "timeout", None)  # torch's
            if timeout is not None and hasattr(timeout, "_join"):
                timeout._join = timedelta(seconds=rejoin_seconds)
        record.joined = True
        _publish_bootstrap(info)
        return info
    return wrapped


def _publish_bootstrap(info: Any) -> None:
    """Rank 0 writes the workers' store address and the round's size into this round's keys,
    every round.

    torch's handler keeps the address of its shared store from its first round and writes it only
    then, under that round's key prefix; an agent that joins a later round for the first time (a
    host that came back) then waits for ``MASTER_ADDR`` under the new round's prefix until its
    read timeout, and the whole job fails (``DistStoreError: wait timeout ... MASTER_ADDR``). The
    size (:data:`ROUND_SIZE_KEY`) tells :class:`Places` which ranks a round had."""
    where = info.bootstrap_store_info
    if info.rank != 0 or where is None:
        return
    info.store.set(type(where).MASTER_ADDR_KEY, where.master_addr.encode())
    info.store.set(type(where).MASTER_PORT_KEY, str(where.master_port).encode())
    info.store.set(ROUND_SIZE_KEY, str(info.world_size))


class Places:
    """An in-process job's way in for an agent that arrives while the job runs: the place of a
    lost agent, taken in the running rendezvous round instead of a new round.

    torch's agents restart all their workers when an agent waits for a new round; with in-process
    recovery the survivors' workers already re-formed without the lost host, and its workers (fixed
    ranks, see :mod:`hvd_trainer.comm.world.quorum`) only need starting again. So an agent that
    finds the round complete takes, in the signed rendezvous state, the place (torch's group rank)
    of a participant that is gone — its heartbeat older than torch's dead-node limit, or its agent
    process gone from this very host (a host's line started again) — and returns that round's
    :class:`RendezvousInfo`: its workers get the lost host's ranks and join the survivors at their
    next step. A round with room to grow (fewer hosts than ``--max-np`` allows) or no round
    running goes through torch's rendezvous as before; a full round whose agents are all alive is
    waited on (a spare, as in Horovod's elastic mode) until a place is free or the job ends.

    Rank 0 (the host of the workers' store) is never taken: without it the job has ended.
    This reads and writes torch's private rendezvous state (``_state_holder``, ``_this_node``);
    a torch without them joins torch's way.
    """

    POLL_SECONDS = 0.5

    def __init__(self, handler: Any, params: RendezvousParameters) -> None:
        self.handler = handler
        interval = params.get_as_int("keep_alive_interval", 5) or 5
        self.dead_after = timedelta(seconds=interval * (params.get_as_int("keep_alive_max_attempt", 3) or 3))
        self.max_nodes = params.max_nodes
        self._seen: dict[int, str] = {}
        """The address last seen at each place (for the line that names whose place is taken)."""

    def _supported(self) -> bool:
        return all(hasattr(self.handler, name) for name in
                   ("_state_holder", "_this_node", "_start_heartbeats", "_get_store"))

    def take(self) -> Any:
        """This agent's :class:`RendezvousInfo` in a lost agent's place, or ``None`` to join
        through torch's rendezvous."""
        if not self._supported():
            return None
        holder, me = self.handler._state_holder, self.handler._this_node
        waited = False
        while True:
            holder.sync()
            state = holder.state
            if not state.complete or state.closed or me in state.participants:
                return None
            size = self._round_size()
            if size is None or size < self.max_nodes:
                return None
            place = self._free_place(state, size)
            if place is not None:
                info = self._claim(place, size)
                if info is not None:
                    return info
                continue  # another agent wrote the state first: read it again
            if not waited:
                print("hvdrun: the job is running with all its hosts; this host waits as a spare and "
                      "takes the place of the first host lost.", file=sys.stderr, flush=True)
                waited = True
            time.sleep(self.POLL_SECONDS)

    def _round_size(self) -> int | None:
        store = self.handler._get_store()
        if not store.check([ROUND_SIZE_KEY]):
            return None
        return int(bytes(store.get(ROUND_SIZE_KEY)).decode())

    def _gone(self, state: Any, node: Any) -> bool:
        beat = state.last_heartbeats.get(node)
        if beat is None or datetime.now(timezone.utc) - beat >= self.dead_after:
            return True
        me = self.handler._this_node
        return node.addr == me.addr and node.pid != me.pid and not pid_alive(node.pid)

    def _free_place(self, state: Any, size: int) -> int | None:
        self._seen.update({rank: node.addr for node, rank in state.participants.items()})
        held = {rank for node, rank in state.participants.items() if not self._gone(state, node)}
        free = [rank for rank in range(1, size) if rank not in held]
        return free[0] if free else None

    def _claim(self, place: int, size: int) -> Any:
        holder, me = self.handler._state_holder, self.handler._this_node
        state = holder.state
        lost = [node for node, rank in state.participants.items() if rank == place]
        for node in lost:
            del state.participants[node]
            state.last_heartbeats.pop(node, None)
        state.participants[me] = place
        state.last_heartbeats[me] = datetime.now(timezone.utc)
        holder.mark_dirty()
        holder.sync()
        if holder.state.participants.get(me) != place:
            return None
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        self.handler._start_heartbeats()
        store = self.handler._get_store()
        bootstrap = RendezvousStoreInfo.build(place, store, local_addr=me.addr)
        self.handler._bootstrap_store_info = bootstrap
        was = f" (that of {self._seen[place]})" if place in self._seen else ""
        print(f"hvdrun: this host takes place {place} of {size}{was} in the running job; its workers "
              "join the others in process.", file=sys.stderr, flush=True)
        return RendezvousInfo(store, place, size, bootstrap)



def use_guarded_rendezvous(args: Any, secret: str | None, *, spares: bool,
                           record: DoorRecord | None = None) -> bool:
    """Switch parsed torchrun ``args`` from the c10d rendezvous to this one; return whether they
    were switched. ``secret``: the job's ``HOROVOD_SECRET_KEY`` (``None`` without one);
    ``spares``: whether an agent arriving at a full job waits as a spare (elastic jobs) instead
    of being refused; ``record``: filled in as the agent goes through the rendezvous."""
    if args.rdzv_backend != "c10d":
        return False
    name = f"{BACKEND}-{next(_REGISTERED)}"  # torch's registry keeps one creator per name
    rendezvous_handler_registry.register(name, functools.partial(_create_handler, secret=secret,
                                                                spares=spares, record=record))
    args.rdzv_backend = name
    return True

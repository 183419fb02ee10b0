"""Named asynchronous collectives matched by name across ranks, as Horovod's negotiation did.

``allreduce_async(t, name="a")`` on one rank and ``allreduce_async(t, name="a")`` on another are
the same collective whatever each rank started in between: rank 0 may start ``"a"`` then ``"b"``
while rank 1 starts ``"b"`` then ``"a"``, or start ``"a"``, pass a ``barrier()`` and only then see
rank 1 start ``"a"`` (Horovod's own duplicate-name tests do this). Collectives without a name,
the blocking forms and the gradient reducer's buckets still match by call order, on the set's
ordered stream; nothing here touches them.

Mechanism, per process set (a :class:`NameMatcher`):

1. Starting a named ``*_async`` collective claims its name on this rank (a second one of the
   same kind and name before the first is synchronized raises
   :class:`~hvd_trainer.comm.ops.checks.DuplicateNameError` at once, as in Horovod) and
   returns a handle; nothing is communicated on the calling thread.
2. One thread per set counts this rank in, in the job's store, under ``(kind, name, n)``
   (``n``: how many times this rank used that name before). The rank whose count completes
   the set appends the collective to the set's queue in the store (one atomic ``add``
   numbers the entries), so every rank reads the same order. The thread reads the queue in
   order while this rank has collectives waiting,
   launches every entry it found on the set's *side group* (a gloo group of the same members,
   created with the set), in queue order, then waits for them: the collective's own cross-rank
   signature check, stall and failure inspection run there as on the ordered stream, on a
   coordinator of their own.
3. ``synchronize`` waits for that thread. Until every member has started the collective it
   warns after ``stall_warning_seconds`` naming the ranks that have not, raises
   :class:`~hvd_trainer.comm.base.errors.StallError` after ``stall_shutdown_seconds`` and
   :class:`~hvd_trainer.comm.base.errors.RankFailedError` when one of them has exited.

The side group carries CUDA tensors through gloo (correct, not fast: name your per-step
collectives only when the order really differs, or leave them unnamed).

With ``join()`` (Horovod's semantics): a rank inside ``join()`` never starts a named collective,
so it counts as present for every name. Its ``join()`` also serves the side set's join board
(:mod:`~hvd_trainer.comm.world.join_board`) from a second thread. The thread of a rank waiting for
a name polls that board once a collective has waited
:data:`~hvd_trainer.comm.ops.checks.JOIN_CHECK_AFTER_SECONDS`; when the only members missing
have joined, it queues the collective (once: an atomic ``add`` elects the rank that writes the
entry). The side set's coordinator then runs it as on the
ordered stream: a joined rank adds zeros to an allreduce and every other kind raises
:class:`~hvd_trainer.comm.base.errors.JoinedRankError` on its callers. Each name's use count
starts again after every ``join()`` (the counts are per join round, the same on every rank).

On by default (:attr:`~hvd_trainer.comm.base.config.CommConfig.match_async_names`);
``HVD_TRAINER_MATCH_ASYNC_NAMES=0`` matches every collective by call order.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hvd_trainer.comm.base.errors import HorovodInternalError, RankFailedError, StallError
from hvd_trainer.comm.ops import movement_async as _movement
from hvd_trainer.comm.ops import reductions_async as _reductions
from hvd_trainer.comm.ops.arguments import require_tensor
from hvd_trainer.comm.ops.checks import JOIN_CHECK_AFTER_SECONDS, Signature
from hvd_trainer.comm.ops.handle import Handle
from hvd_trainer.comm.ops.process_set import ProcessSet, resolve_set
from hvd_trainer.comm.ops.reduce import run_identity_allreduce
from hvd_trainer.comm.world.liveness import describe_gone, find_gone

__all__ = [
    "NameMatcher", "route", "matcher_for",
    "allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "reducescatter_async", "grouped_reducescatter_async", "allgather_async", "grouped_allgather_async",
    "broadcast_async", "broadcast_async_", "alltoall_async",
]

_POLL_FIRST_SECONDS = 0.0002
_POLL_MAX_SECONDS = 0.005
"""The queue is polled from 0.2 ms, doubling to 5 ms while nothing new arrives (only while
this rank has a collective waiting for its turn)."""
_WAIT_SLICE_SECONDS = 0.05
_ABANDON_JOIN_SECONDS = 5.0
"""How long a failed ``join()`` waits for its side-board thread before leaving it (a daemon)."""
_PROBE_EVERY_SECONDS = 0.5


class _Pending:
    """One named collective on this rank, from its start until its result is read."""

    __slots__ = ("key", "label", "launch", "flight", "started", "done", "result", "error")

    def __init__(self, key: str, label: str, launch: Callable[[ProcessSet], Handle], flight: str) -> None:
        self.key, self.label, self.launch, self.flight = key, label, launch, flight
        self.started = time.monotonic()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def start(self, side: ProcessSet) -> Handle | None:
        """Launch on the side set (in the matcher's thread); ``None`` when launching raised."""
        try:
            return self.launch(side)
        except BaseException as exc:  # noqa: BLE001 - delivered to synchronize()
            self.error = exc
            self.done.set()
            return None

    def finish(self, handle: Handle | None) -> None:
        """Wait for the launched collective and record its result (in the matcher's thread)."""
        if handle is None:
            return
        try:
            self.result = handle.wait()
        except BaseException as exc:  # noqa: BLE001 - delivered to synchronize()
            self.error = exc
        finally:
            self.done.set()


class NameMatcher:
    """Matches one process set's named async collectives by name (see the module docstring).

    Args:
        pset: the set (this rank is a member; it has a side group).
        store: the job's key-value store of the set's world.
    """

    def __init__(self, pset: ProcessSet, store: Any) -> None:
        self._pset = pset
        self._side = pset.side_set()
        self._store = store
        self._prefix = f"hvd/ps{pset.set_id}/named"
        self._rank = pset.global_rank
        self._ranks = tuple(pset.ranks)
        self._bits = len(self._ranks) <= 62
        self._uses: dict[str, int] = {}
        self._round = 0
        """The side set's join round the use counts in ``_uses`` belong to."""
        self._join_checked = 0.0
        self._waiting: dict[str, _Pending] = {}
        """Started here, not yet read from the queue (touched under ``_cv``)."""
        self._fresh: list[_Pending] = []
        """Started here, not yet counted in the store (touched under ``_cv``)."""
        self._cv = threading.Condition()
        self._wake = threading.Event()
        self._closed = False
        self._next = 1
        self._thread: threading.Thread | None = None

    @property
    def side(self) -> ProcessSet:
        """The set's members on the side group, where matched collectives run."""
        return self._side

    # -- main thread ----------------------------------------------------------------------
    def submit(self, kind: str, name: str, launch: Callable[[ProcessSet], Handle]) -> Handle:
        """Start the collective ``kind`` named ``name``; ``launch(side_set)`` starts it for real
        once every member has submitted it, and returns its handle.

        Raises:
            DuplicateNameError: one of the same kind and name is in flight on this rank.
            HorovodInternalError: the matcher was closed (shutdown, removed set).
        """
        if self._closed:
            raise HorovodInternalError(f"{kind} {name!r}: this process set was shut down or removed.")
        sig = Signature(kind, name)
        flight = self._pset.coordinator.claim_name(sig)
        board = self._side.coordinator.board
        if board.round != self._round:  # every member left a join(): counts start again
            self._round = board.round
            self._uses.clear()
        use = self._uses.get(flight, 0)
        self._uses[flight] = use + 1
        pending = _Pending(f"{flight}#{self._round}.{use}", sig.label(), launch, flight)
        with self._cv:
            self._waiting[pending.key] = pending
            self._fresh.append(pending)
            self._ensure_thread()
            self._cv.notify()
        self._wake.set()
        return Handle([_Part(self, pending)], lambda: pending.result)

    def wait(self, pending: _Pending) -> None:
        """Block until ``pending`` ran, inspecting for missing and failed ranks meanwhile; free
        its name. Raises what the collective raised, or StallError / RankFailedError."""
        next_probe = 0.0
        warned = False
        try:
            while not pending.done.wait(_WAIT_SLICE_SECONDS):
                if self._closed:
                    raise HorovodInternalError(
                        f"{pending.label} never ran: the process set was shut down or removed "
                        "before every member started it."
                    )
                elapsed = time.monotonic() - pending.started
                if elapsed < min(self._config().suspect_after_seconds,
                                 self._config().stall_warning_seconds or float("inf")):
                    continue
                missing = self._missing(pending.key)
                if not missing:
                    continue  # queued or running: the side set's coordinator inspects the transport
                if time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + _PROBE_EVERY_SECONDS
                    self._raise_if_gone(pending, missing)
                warned = self._inspect_stall(pending, missing, elapsed, warned)
        finally:
            self._pset.coordinator.release_name(pending.flight)
        if pending.error is not None:
            raise pending.error

    def drain(self) -> None:
        """Block until every named collective this rank started has run (results and errors
        stay with their handles for ``synchronize``); called by ``join()`` first."""
        with self._cv:
            waiting = list(self._waiting.values())
        for pending in waiting:
            while not pending.done.wait(_WAIT_SLICE_SECONDS):
                if self._closed:
                    return

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        """Serve the side set's join board from a second thread while the body serves the
        set's own board (``join()``): a joined rank adds zeros to the named allreduces the
        active ranks run meanwhile. Every member enters this before the set's own board, so
        the side board is complete once the body returns; the body's stall inspection speaks
        for both (an error in the body stops the second thread).

        Raises:
            Whatever serving the side board raised (a failed peer, a closed transport).
        """
        self.drain()
        side = self._side.coordinator
        stop = threading.Event()
        failure: list[BaseException] = []

        def on_idle(_seconds: float) -> None:
            if stop.is_set():
                raise _JoinAbandoned

        def serve() -> None:
            try:
                _, side.seq = side.board.serve(
                    side.seq, lambda tr: run_identity_allreduce(tr, self._side), on_idle)
                side.forget_history()
            except _JoinAbandoned:
                pass
            except BaseException as exc:  # noqa: BLE001 - re-raised by join()
                failure.append(exc)

        thread = threading.Thread(target=serve, name=f"hvd-join-ps{self._pset.set_id}", daemon=True)
        thread.start()
        try:
            yield
        except BaseException:
            stop.set()  # the thread may be inside a collective with a failed peer: do not wait long
            thread.join(timeout=_ABANDON_JOIN_SECONDS)
            raise
        thread.join()
        if failure:
            raise failure[0]

    def close(self) -> None:
        """Stop the thread; collectives not started by every member fail at ``synchronize``."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    # -- inspection -----------------------------------------------------------------------
    def _config(self) -> Any:
        return self._pset.coordinator.config

    def _missing(self, key: str) -> list[int]:
        try:
            if self._bits:
                mask = self._store.add(f"{self._prefix}/bits/{key}", 0)
                return [r for i, r in enumerate(self._ranks) if not mask >> i & 1]
            who = f"{self._prefix}/who/{key}"
            return [r for r in self._ranks if not self._store.check([f"{who}/{r}"])]
        except RuntimeError:
            return []  # the store went with a failed peer: the transport inspection reports it

    def _raise_if_gone(self, pending: _Pending, missing: list[int]) -> None:
        try:
            gone = find_gone(self._store, missing)
        except Exception:  # noqa: BLE001 - the store may be gone with the failed peer
            return
        if gone:
            raise RankFailedError(describe_gone(f"{pending.label} (matched by name)", gone))

    def _inspect_stall(self, pending: _Pending, missing: list[int], elapsed: float, warned: bool) -> bool:
        cfg = self._config()
        text = (
            f"rank(s) {missing} have not started {pending.label} (matched by name on process set "
            f"{list(self._ranks)}) after {elapsed:.1f}s; rank {self._rank} is waiting for them."
        )
        if cfg.stall_shutdown_seconds and elapsed >= cfg.stall_shutdown_seconds:
            raise StallError(text + " HINT: every member must start a named collective; a rank "
                             "is stuck, crashed, or skipped it.")
        if cfg.stall_warning_seconds and elapsed >= cfg.stall_warning_seconds and not warned:
            warnings.warn(text, RuntimeWarning, stacklevel=4)
            return True
        return warned

    # -- the thread -----------------------------------------------------------------------
    def _announce(self, pending: _Pending) -> None:
        """Count this rank in for ``pending``; the member that completes the set queues it for
        every member. Sets of up to 62 members add this member's bit (one round trip, and the
        sum names who is missing); larger sets add 1 and leave a mark per rank. A store error
        fails the collective (it is raised by ``synchronize``)."""
        key = pending.key
        try:
            if self._bits:
                bit = 1 << self._ranks.index(self._rank)
                last = self._store.add(f"{self._prefix}/bits/{key}", bit) == (1 << len(self._ranks)) - 1
            else:
                self._store.set(f"{self._prefix}/who/{key}/{self._rank}", "1")
                last = self._store.add(f"{self._prefix}/count/{key}", 1) == len(self._ranks)
            if last:
                slot = self._store.add(f"{self._prefix}/length", 1)
                self._store.set(f"{self._prefix}/queue/{slot}", key)
        except BaseException as exc:  # noqa: BLE001 - delivered to synchronize()
            with self._cv:
                self._waiting.pop(key, None)
            pending.error = exc
            pending.done.set()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"hvd-named-ps{self._pset.set_id}",
                                            daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        delay = _POLL_FIRST_SECONDS
        running: collections.deque[tuple[_Pending, Handle | None]] = collections.deque()
        while True:
            with self._cv:
                while not self._closed and not self._waiting and not running:
                    self._cv.wait()
                if self._closed:
                    return
                fresh, self._fresh = self._fresh, []
                expecting = bool(self._waiting)
            if expecting:
                self._queue_for_joined()
            if self._advance(fresh, expecting, running):
                delay = _POLL_FIRST_SECONDS
            elif running:  # nothing else to do: wait for the oldest (its checks inspect stalls)
                pending, handle = running.popleft()
                pending.finish(handle)
            else:
                self._wake.clear()
                with self._cv:
                    idle = not self._fresh
                if idle:
                    self._wake.wait(delay)
                    delay = min(2 * delay, _POLL_MAX_SECONDS)

    def _queue_for_joined(self) -> None:
        """Queue the collectives whose only missing members are inside ``join()`` (looked for
        at most every JOIN_CHECK_AFTER_SECONDS, once one has waited that long). Several
        members may find the same one: an atomic ``add`` elects the one that queues it."""
        now = time.monotonic()
        if now - self._join_checked < JOIN_CHECK_AFTER_SECONDS:
            return
        with self._cv:
            waited = [p for p in self._waiting.values() if now - p.started >= JOIN_CHECK_AFTER_SECONDS]
        if not waited:
            return
        self._join_checked = now
        board = self._side.coordinator.board
        try:
            if not board.started():
                return
            joined = board.joined_ranks()
            for pending in waited:
                missing = self._missing(pending.key)
                if missing and set(missing) <= joined \
                        and self._store.add(f"{self._prefix}/elect/{pending.key}", 1) == 1:
                    slot = self._store.add(f"{self._prefix}/length", 1)
                    self._store.set(f"{self._prefix}/queue/{slot}", pending.key)
        except RuntimeError:
            return  # a lost store: waiters find the failed peer themselves

    def _advance(self, fresh: list[_Pending], expecting: bool,
                 running: collections.deque[tuple[_Pending, Handle | None]]) -> bool:
        """Count ``fresh`` in, launch what the queue made ready (in queue order, the same on
        every member) and finish what completed, without blocking. True when anything moved."""
        for pending in fresh:
            self._announce(pending)
        ready = self._read_queue() if expecting else []
        if ready:
            self._side.coordinator.timeline = self._pset.coordinator.timeline
        for pending in ready:
            running.append((pending, pending.start(self._side)))
        finished = False
        while running and (running[0][1] is None or running[0][1].poll()):
            pending, handle = running.popleft()
            pending.finish(handle)
            finished = True
        return bool(fresh or ready or finished)

    def _read_queue(self) -> list[_Pending]:
        """Every entry queued from ``_next`` on (in order), taken out of ``_waiting``: one round
        trip for the queue's length, one for its new entries (a slot is numbered just before
        its entry is written, so reading it waits that long at most)."""
        try:
            length = self._store.add(f"{self._prefix}/length", 0)
            if length < self._next:
                return []
            keys = self._store.multi_get([f"{self._prefix}/queue/{i}" for i in range(self._next, length + 1)])
        except RuntimeError:
            return []  # a lost store: waiters find the failed peer themselves
        self._next = length + 1
        ready: list[_Pending] = []
        with self._cv:
            for raw in keys:
                key = raw.decode() if isinstance(raw, bytes) else str(raw)
                pending = self._waiting.pop(key, None)
                if pending is not None:  # every member counted itself in, so it is here
                    ready.append(pending)
        return ready


class _JoinAbandoned(Exception):
    """Stops the side board's serving thread when ``join()`` itself failed."""


class _Part:
    """A :class:`Handle` part for a collective matched by name."""

    __slots__ = ("_matcher", "_pending")

    def __init__(self, matcher: NameMatcher, pending: _Pending) -> None:
        self._matcher, self._pending = matcher, pending

    def poll(self) -> bool:
        return self._pending.done.is_set()

    def finish(self) -> None:
        self._matcher.wait(self._pending)


def matcher_for(pset: ProcessSet) -> NameMatcher | None:
    """The set's matcher (made on first use); ``None`` where names match by call order."""
    if pset.name_matcher is None:
        runtime = pset._runtime
        if pset.side_group is None or runtime is None or runtime.store is None:
            return None
        pset.name_matcher = NameMatcher(pset, runtime.store)
    return pset.name_matcher


def route(kind: str, name: str | None, process_set: ProcessSet | None, world: Any,
          launch: Callable[[ProcessSet | None], Handle]) -> Handle:
    """Start ``launch`` matched by ``name`` when the set has a matcher, else at once (in call
    order). ``launch(set)`` starts the collective on ``set`` and returns its handle.

    Raises:
        DuplicateNameError: see :meth:`NameMatcher.submit`.
    """
    if name is None:
        return launch(process_set)
    pset = resolve_set(process_set, world, kind)
    matcher = matcher_for(pset)
    if matcher is None:
        return launch(process_set)
    return matcher.submit(kind, name, launch)


def _matched(fn: Callable[..., Handle], kind: str) -> Callable[..., Handle]:
    """``fn`` (an async collective of ``comm.ops``) with its named calls matched by name."""
    params = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Handle:
        bound = params.bind(*args, **kwargs)
        first = next(iter(bound.arguments.values()))
        for t in (first if isinstance(first, Sequence) and not isinstance(first, str) else [first]):
            require_tensor(t, kind)  # a wrong argument raises at the call, not at synchronize

        def launch(target: ProcessSet | None) -> Handle:
            bound.arguments["process_set"] = target
            return fn(*bound.args, **bound.kwargs)

        return route(kind, bound.arguments.get("name"), bound.arguments.get("process_set"),
                     bound.arguments.get("world"), launch)

    wrapper.__doc__ = (fn.__doc__ or "") + (
        "\n\n    A named call is matched with the other ranks' calls of that name, whatever their "
        "order (:mod:`hvd_trainer.comm.ops.by_name`)."
    )
    return wrapper


allreduce_async = _matched(_reductions.allreduce_async, "allreduce")
allreduce_async_ = _matched(_reductions.allreduce_async_, "allreduce")
grouped_allreduce_async = _matched(_reductions.grouped_allreduce_async, "grouped_allreduce")
grouped_allreduce_async_ = _matched(_reductions.grouped_allreduce_async_, "grouped_allreduce")
reducescatter_async = _matched(_reductions.reducescatter_async, "reducescatter")
grouped_reducescatter_async = _matched(_reductions.grouped_reducescatter_async, "grouped_reducescatter")
allgather_async = _matched(_movement.allgather_async, "allgather")
grouped_allgather_async = _matched(_movement.grouped_allgather_async, "grouped_allgather")
broadcast_async = _matched(_movement.broadcast_async, "broadcast")
broadcast_async_ = _matched(_movement.broadcast_async_, "broadcast")
alltoall_async = _matched(_movement.alltoall_async, "alltoall")

"""The membership rounds of in-process recovery over a real TCPStore, one thread per worker.

Each thread plays one worker (its own slot and host name; a live one has this process's pid, a dead
one the pid of a process that really ended), so the known-dead rule is exercised as in a job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from hvd_trainer.comm import RankFailedError
from hvd_trainer.comm.world.quorum import JobFinished, Membership, Quorum, gone_key


@pytest.fixture
def store() -> Any:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    yield server


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _client(server: Any) -> Any:
    return dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))


def _quorum(server: Any, slot: int, *, host: str = "h1", pid: int | None = None, min_np: int = 1,
            settle: float = 5.0, timeout: float = 20.0, slots: int = 3) -> Quorum:
    return Quorum(_client(server), "job", slot=slot, max_slots=slots, min_np=min_np, settle_seconds=settle,
                  timeout_seconds=timeout, host=host, pid=os.getpid() if pid is None else pid)


def _in_threads(calls: list[Callable[[], Any]]) -> list[Any]:
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _slots(m: Membership) -> list[int]:
    return [x.slot for x in m.members]


def test_first_round_takes_every_launched_slot_in_slot_order(store: Any) -> None:
    qs = [_quorum(store, s) for s in (2, 0, 1)]
    got = _in_threads([q.join for q in qs])
    assert all(isinstance(m, Membership) for m in got), got
    assert {m.epoch for m in got} == {1}
    assert all(_slots(m) == [0, 1, 2] for m in got)
    assert [m.rank_of(q.slot) for m, q in zip(got, qs, strict=True)] == [2, 0, 1]


def test_survivors_close_at_once_when_the_missing_worker_on_this_host_is_dead(store: Any) -> None:
    dead = _dead_pid()
    qs = [_quorum(store, 0), _quorum(store, 1), _quorum(store, 2, pid=dead)]
    _in_threads([q.join for q in qs])
    start = time.monotonic()
    got = _in_threads([qs[0].reform, qs[1].reform])
    assert all(_slots(m) == [0, 1] and m.epoch == 2 for m in got), got
    assert time.monotonic() - start < 2.0  # not the 5 s settle: slot 2's pid is gone


def test_a_missing_worker_on_another_host_is_waited_for_settle_seconds(store: Any) -> None:
    qs = [_quorum(store, 0, settle=1.0, slots=2), _quorum(store, 1, host="h2", settle=1.0, slots=2)]
    _in_threads([q.join for q in qs])
    start = time.monotonic()
    m = qs[0].reform()
    waited = time.monotonic() - start
    assert _slots(m) == [0] and 0.9 <= waited < 3.0, waited


def test_a_rank_the_heartbeat_lost_is_not_waited_for(store: Any) -> None:
    qs = [_quorum(store, 0, slots=2), _quorum(store, 1, host="h2", slots=2)]
    _in_threads([q.join for q in qs])
    start = time.monotonic()
    m = qs[0].reform(lost_ranks=[1])
    assert _slots(m) == [0] and time.monotonic() - start < 1.0


def test_a_worker_on_another_host_reported_gone_by_its_agent_is_not_waited_for(store: Any) -> None:
    """hvdrun's agent on h2 writes ``gone/<slot>/<pid>`` when the worker entry starts the slot
    again: the round closes without the settle wait (60 s here)."""
    qs = [_quorum(store, 0, settle=60.0, slots=2),
          _quorum(store, 1, host="h2", pid=4242, settle=60.0, slots=2)]
    _in_threads([q.join for q in qs])
    _client(store).set(gone_key("job", 1, 4242), "h2")
    start = time.monotonic()
    m = qs[0].reform()
    assert _slots(m) == [0] and time.monotonic() - start < 30.0


def test_a_gone_mark_for_another_process_of_the_slot_is_not_this_member(store: Any) -> None:
    """The mark names a pid: one for the slot's earlier process leaves its new one waited for."""
    qs = [_quorum(store, 0, settle=1.0, slots=2), _quorum(store, 1, host="h2", pid=4242, settle=1.0, slots=2)]
    _in_threads([q.join for q in qs])
    _client(store).set(gone_key("job", 1, 4241), "h2")
    start = time.monotonic()
    m = qs[0].reform()
    assert _slots(m) == [0] and time.monotonic() - start >= 0.9


def test_a_live_slow_member_on_this_host_is_waited_for(store: Any) -> None:
    qs = [_quorum(store, s, slots=2) for s in (0, 1)]  # both alive (this process)
    _in_threads([q.join for q in qs])

    def slow() -> Membership:
        time.sleep(1.0)
        return qs[1].reform()

    got = _in_threads([qs[0].reform, slow])
    assert all(_slots(m) == [0, 1] for m in got), got


def test_a_joiner_is_let_in_at_the_same_check_on_every_member(store: Any) -> None:
    dead = _dead_pid()
    qs = [_quorum(store, 0), _quorum(store, 1), _quorum(store, 2, pid=dead)]
    _in_threads([q.join for q in qs])
    _in_threads([qs[0].reform, qs[1].reform])  # slot 2 lost: members 0, 1
    joiner = _quorum(store, 2)
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(joiner.join()))
    thread.start()
    time.sleep(0.3)  # the joiner has arrived at round 3
    due = [[q.reform_due() for _ in range(4)] for q in qs[:2]]
    # rank 0 finds the arrival at check 1 and schedules check 2; both members leave there
    assert due == [[False, True, True, True]] * 2
    got = _in_threads([qs[0].reform, qs[1].reform])
    thread.join(10)
    assert all(_slots(m) == [0, 1, 2] and m.epoch == 3 for m in [*got, *result]), (got, result)


def test_a_round_below_min_np_waits_and_then_fails_clearly(store: Any) -> None:
    dead = _dead_pid()
    qs = [_quorum(store, 0, min_np=2, timeout=1.5, slots=2), _quorum(store, 1, pid=dead, min_np=2, slots=2)]
    _in_threads([q.join for q in qs])
    with pytest.raises(RankFailedError, match="did not form within 1.5 s .*at least 2 workers"):
        qs[0].reform()


def test_a_joiner_left_waiting_when_the_job_finished_ends_quietly(store: Any) -> None:
    qs = [_quorum(store, 0, slots=2), _quorum(store, 1, slots=2)]
    _in_threads([q.join for q in qs])
    qs[0].finish()
    with pytest.raises(JobFinished):
        _quorum(store, 1, slots=2).join()


def test_every_worker_restarted_closes_the_round_without_the_old_members(store: Any) -> None:
    dead = [_dead_pid(), _dead_pid()]
    qs = [_quorum(store, s, pid=dead[s], slots=2) for s in (0, 1)]
    _in_threads([q.join for q in qs])
    again = [_quorum(store, s, slots=2) for s in (0, 1)]
    got: dict[int, Any] = {}
    closed = threading.Event()

    def enter(slot: int) -> None:
        got[slot] = again[slot].join()
        closed.set()

    threads = [threading.Thread(target=enter, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    assert closed.wait(20)  # the first round to close
    deadline = time.monotonic() + 20
    (first, members), = list(got.items())[:1]
    assert members.epoch == 2 and os.getpid() in [m.pid for m in members.members], members
    if _slots(members) != [0, 1]:
        # The other restarted worker arrived after the first closed round 2 without it (both old
        # pids are dead): it waits at round 3, which the member opens at its next step boundary.
        while not again[first].reform_due() and time.monotonic() < deadline:
            pass  # each call is one step boundary (store round trips)
        got[first] = again[first].reform()
    for t in threads:
        t.join(20)
    final = [got.get(0), got.get(1)]
    assert all(m is not None and _slots(m) == [0, 1] and m.epoch in (2, 3) for m in final), final
    assert final[0] == final[1] and not set(dead) & {m.pid for m in final[0].members}, final


def test_slot_outside_max_np_is_refused(store: Any) -> None:
    with pytest.raises(ValueError, match="--max-np must cover"):
        _quorum(store, 3, slots=2)


def test_the_first_round_waits_for_every_launched_worker_however_late(store: Any) -> None:
    qs = [_quorum(store, s, settle=0.2, slots=2) for s in (0, 1)]

    def late() -> Membership:
        time.sleep(1.0)  # five settle times: a slow import on a busy machine
        return qs[1].join()

    got = _in_threads([qs[0].join, late])
    assert all(_slots(m) == [0, 1] and m.epoch == 1 for m in got), got

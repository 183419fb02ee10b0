"""comm.world.liveness: which peer died, from the store's host|pid records and /proc."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from hvd_trainer.comm.world import liveness


def _store_with(records: dict[int, str]) -> dist.HashStore:
    store = dist.HashStore()
    for rank, value in records.items():
        store.set(f"hvd/proc/{rank}", value)
    return store


def test_killed_unreaped_child_counts_as_dead_and_is_named() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = socket.gethostname()
        store = _store_with(
            {0: f"{host}|{os.getpid()}", 1: f"{host}|{child.pid}", 2: f"far-away|{child.pid}"}
        )
        dead, remote = liveness.find_dead_peers(store, [0, 1, 2], me=0, grace_seconds=0.0)
        assert dead == [] and remote == [liveness.Peer(2, "far-away", child.pid)]
        os.kill(child.pid, signal.SIGKILL)
        time.sleep(0.2)  # not reaped: a zombie, which os.kill(pid, 0) alone would call alive
        dead, _ = liveness.find_dead_peers(store, [0, 1, 2], me=0, grace_seconds=2.0)
        assert dead == [liveness.Peer(1, host, child.pid)]
        message = liveness.describe_failure("allreduce 'x' (collective #3)", dead, [])
        want = f"allreduce 'x' (collective #3) failed because rank 1 (pid {child.pid} on {host})"
        assert message.startswith(want)
    finally:
        child.kill()
        child.wait()


def test_only_remote_peers_are_listed_as_candidates_and_unknown_gives_none() -> None:
    remote = [liveness.Peer(3, "h2", 11)]
    assert "rank 3 on h2" in liveness.describe_failure("barrier (collective #1)", [], remote)
    assert liveness.describe_failure("barrier (collective #1)", [], []) is None
    store = _store_with({})
    assert liveness.find_dead_peers(store, [0, 1], me=0, grace_seconds=0.0) == ([], [])


def test_exited_mark_names_a_rank_on_any_host_until_it_publishes_again() -> None:
    store = _store_with({1: f"far-away|{os.getpid() + 1}"})
    assert liveness.find_gone(store, [1]) == []  # remote and unmarked: cannot tell
    liveness.mark_exited(store, 1)
    gone = liveness.find_gone(store, [1])
    assert gone == [liveness.Peer(1, "far-away", os.getpid() + 1)]
    assert liveness.find_dead_peers(store, [0, 1], me=0, grace_seconds=0.0)[0] == gone
    message = liveness.describe_gone("allreduce 'm' (collective #7)", gone)
    assert message.startswith("allreduce 'm' (collective #7) cannot complete: rank 1 (pid")
    assert "has exited" in message and "HINT:" in message
    liveness.publish(store, 1)  # a re-initialised rank 1 clears its old mark
    assert liveness.find_gone(store, [1]) == []


def test_a_rank_that_left_for_a_peer_is_not_blamed_and_the_error_points_at_other_hosts() -> None:
    host = socket.gethostname()
    store = _store_with({1: f"{host}|{os.getpid() + 1}", 2: "far-away|7", 3: "far-away|8"})
    liveness.mark_exited(store, 1, for_a_peer=True)
    dead, remote = liveness.find_dead_peers(store, [0, 1, 2, 3], me=0, grace_seconds=0.0)
    assert dead == [liveness.Peer(1, host, os.getpid() + 1)]
    relayed = liveness.stopped_for_peers(store, dead)
    assert relayed == dead
    message = liveness.describe_failure("allreduce 'x' (collective #4)", dead, remote, relayed)
    assert "stopped because it lost a peer too, so the first failure is elsewhere" in message
    assert "one of the ranks on other hosts (rank 2 on far-away, rank 3 on far-away)" in message
    assert "no longer running" not in message
    # a rank that failed on its own is still named as the cause, next to a relayed one
    liveness.mark_exited(store, 2, for_a_peer=False)
    dead = [liveness.Peer(1, host, os.getpid() + 1), liveness.Peer(2, "far-away", 7)]
    relayed = liveness.stopped_for_peers(store, dead)
    assert relayed == dead[:1]
    message = liveness.describe_failure("allreduce 'x' (collective #4)", dead, [], relayed)
    assert message.startswith("allreduce 'x' (collective #4) failed because rank 2 (pid 7 on far-away)")
    # the default reads this process's own state: it raised no peer failure
    liveness.mark_exited(store, 3)
    assert liveness.stopped_for_peers(store, [liveness.Peer(3, "far-away", 8)]) == []


def test_a_rank_about_to_raise_waits_for_its_neighbours_on_this_host_only() -> None:
    # a live neighbour that does nothing until it is killed
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        host = socket.gethostname()
        store = _store_with({0: f"{host}|{os.getpid()}", 1: f"{host}|{child.pid}",
                             2: f"far-away|{child.pid}"})
        # the neighbour (rank 1) never raises: bounded by the timeout; far-away rank 2 is not awaited
        assert liveness.find_raising(store, [0, 1, 2], me=1) == []
        started = time.monotonic()
        liveness.await_local_raising(store, [0, 1, 2], me=0, timeout_seconds=0.3)
        assert 0.3 <= time.monotonic() - started < 2.0
        # rank 0 is leaving: a rank waiting for it in a collective can tell
        assert liveness.find_raising(store, [0, 1, 2], me=1) == [liveness.Peer(0, host, os.getpid())]
        assert liveness.find_raising(store, [1, 2], me=1) == []
        # the neighbour marks itself while rank 0 waits: rank 0 goes on at once
        marker = threading.Timer(0.2, lambda: store.set("hvd/raising/1", str(child.pid)))
        started = time.monotonic()
        marker.start()
        liveness.await_local_raising(store, [0, 1, 2], me=0, timeout_seconds=30.0)
        assert 0.2 <= time.monotonic() - started < 5.0
        # at its exit, rank 0 waits for the neighbour's "exited" mark (its error is printed then)
        exiter = threading.Timer(0.3, lambda: liveness.mark_exited(store, 1, for_a_peer=True))
        started = time.monotonic()
        exiter.start()
        liveness._await_local_exits(timeout_seconds=30.0)
        assert 0.3 <= time.monotonic() - started < 5.0
        # the last to mark itself finds everyone marked: no wait at all
        started = time.monotonic()
        liveness.await_local_raising(store, [0, 1, 2], me=1, timeout_seconds=30.0)
        assert time.monotonic() - started < 0.4
        # publishing again (a new world after an in-process recovery) clears the mark
        liveness.publish(store, 1)
        assert not store.check(["hvd/raising/1"]) and liveness._exit_wait is None
        store.set("hvd/proc/1", f"{host}|{child.pid}")  # publish() wrote this process's pid
        # a neighbour that ended is not awaited
        child.kill()
        child.wait()
        started = time.monotonic()
        liveness.await_local_raising(store, [0, 1, 2], me=0, timeout_seconds=30.0)
        assert time.monotonic() - started < 0.4
    finally:
        child.kill()
        child.wait()

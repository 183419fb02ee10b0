"""The heartbeat that names unreachable hosts (hvd_trainer.comm.world.heartbeat).

The judge is pure (every time is passed in); the watches talk to a real TCPStore on loopback.
The multi-host behaviour (a cut veth link) is tested in tests/multihost/test_faults.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from hvd_trainer.comm.base.config import CommConfig
from hvd_trainer.comm.base.errors import HostUnreachableError, RankFailedError
from hvd_trainer.comm.world.heartbeat import (
    AwakeClock,
    PeerState,
    PeerWatch,
    interval_for,
    judge,
    read_records,
)
from hvd_trainer.comm.world.world import free_port
from hvd_trainer.launch.partition_watch import partition_line

pytestmark = pytest.mark.timeout(60)


def _peers(**hosts_and_times: tuple[str, float]) -> dict[int, PeerState]:
    return {int(k[1:]): PeerState(host=h, pid=1, count="3", changed_at=t)
            for k, (h, t) in hosts_and_times.items()}


def test_a_silent_peer_is_named_with_its_host_after_the_timeout() -> None:
    peers = _peers(r1=("h1", 100.0), r2=("h2", 80.0), r3=("h2", 80.0))
    common = dict(me=0, my_host="h1", store_addr="h1:29400", timeout_seconds=20.0)
    assert judge(now=99.0, last_round_at=99.0, peers=peers, **common) is None
    found = judge(now=100.5, last_round_at=100.2, peers=peers, **common)
    assert found is not None and found.hosts == ("h2",) and found.ranks == (2, 3)
    assert "rank 0 on h1 has not heard from h2 (ranks 2, 3) for 20.5 s" in found.message
    assert "HOROVOD_GLOO_TIMEOUT_SECONDS" in found.message and "HINT" in found.message
    assert isinstance(found.error(), HostUnreachableError) and isinstance(found.error(), RankFailedError)


def test_a_rank_that_cannot_reach_the_store_names_the_store_host_not_silent_peers() -> None:
    peers = _peers(r0=("h1", 50.0), r1=("h1", 50.0), r3=("h2", 50.0))
    found = judge(now=71.0, last_round_at=50.5, peers=peers, me=2, my_host="h2",
                  store_addr="h1:41000", timeout_seconds=20.0)
    assert found is not None and found.hosts == ("h1",) and found.ranks == (0, 1)
    assert found.message.startswith("rank 2 on h2 cannot reach the job's store at h1:41000 for 20.5 s")
    assert "cut off from h1; unreachable: h1 (ranks 0, 1)" in found.message


def test_a_peer_that_stopped_cleanly_is_never_silent() -> None:
    peers = _peers(r1=("h2", 0.0))
    peers[1].stopped = True
    assert judge(now=100.0, last_round_at=100.0, peers=peers, me=0, my_host="h1",
                 store_addr="h1:1", timeout_seconds=5.0) is None


def test_interval_is_a_tenth_of_the_timeout_within_bounds() -> None:
    assert interval_for(20.0) == 2.0 and interval_for(5.0) == 0.5 and interval_for(0.5) == 0.2


def test_the_timeout_comes_from_horovods_gloo_timeout_variable() -> None:
    assert CommConfig.from_env({}).peer_timeout_seconds == 10.0
    assert CommConfig.from_env({"HOROVOD_GLOO_TIMEOUT_SECONDS": "7.5"}).peer_timeout_seconds == 7.5
    assert CommConfig.from_env({"HOROVOD_GLOO_TIMEOUT_SECONDS": "0"}).peer_timeout_seconds == 0.0
    with pytest.raises(ValueError, match="peer_timeout_seconds"):
        CommConfig(peer_timeout_seconds=-1)


def test_the_awake_clock_counts_a_gap_between_readings_as_at_most_its_step() -> None:
    clock = AwakeClock(max_step=0.2)
    before = clock.read()
    time.sleep(0.6)  # the gap itself is what is measured: three steps' worth of not reading
    gap = clock.read() - before
    assert 0.0 < gap <= 0.2
    readings = [clock.read() for _ in range(1000)]
    assert readings == sorted(readings)  # never decreasing
    with pytest.raises(ValueError, match="max_step"):
        AwakeClock(max_step=0)


class _Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []

    def __call__(self, code: int) -> None:
        self.codes.append(code)


def _wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def server():
    """The port of a TCPStore served by a process of its own (a server destroyed inside pytest's
    process while a watch's thread was still in a call on it is the likely cause of a silent
    abort of the whole test run, seen once in CI)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _STORE, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        yield port
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def _watch(port: int, rank: int, tmp_path, exits: _Exits, prefix: str = "t",
           timeout: float = 1.0) -> PeerWatch:
    return PeerWatch(store_host="127.0.0.1", store_port=port, key_prefix=prefix, rank=rank, size=2,
                     timeout_seconds=timeout, grace_seconds=0.5, job_dir=str(tmp_path), hard_exit=exits)


def test_watches_that_beat_find_nothing_and_a_stopped_peer_stays_quiet(server, tmp_path) -> None:
    exits = _Exits()
    a, b = _watch(server, 0, tmp_path, exits), _watch(server, 1, tmp_path, exits)
    a.start(), b.start()
    try:
        time.sleep(2.5)  # 2.5 timeouts of beating
        assert a.failure is None and b.failure is None
        assert a.peers[1].count not in ("", "stopped") and a.peers[1].host == b.host
        b.stop()  # a clean stop (shutdown) leaves the "stopped" mark
        time.sleep(2.0)
        assert a.failure is None and a.peers[1].stopped
    finally:
        a.stop()
    assert exits.codes == [] and read_records(tmp_path) == []


_PEER = """
import sys, time
from hvd_trainer.comm.world.heartbeat import PeerWatch
w = PeerWatch(store_host="127.0.0.1", store_port=int(sys.argv[1]), key_prefix="t", rank=1, size=2,
              timeout_seconds=1.0)
w.start()
time.sleep(60)
"""


def test_a_peer_that_goes_silent_is_reported_recorded_and_the_process_ended(server, tmp_path) -> None:
    exits = _Exits()
    a = _watch(server, 0, tmp_path, exits)
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(server)])
    a.start()
    try:
        assert _wait_for(lambda: 1 in a.peers and a.peers[1].count != "")
        assert a.peers[1].pid == peer.pid
        os.kill(peer.pid, signal.SIGSTOP)  # frozen: its threads beat no more, nothing closes
        assert _wait_for(lambda: a.failure is not None)
        assert a.failure.ranks == (1,) and "has not heard from" in a.failure.message
        # Nobody raised it in a main thread: the judge ends the process after the grace period.
        assert _wait_for(lambda: exits.codes == [75], timeout=5.0)
    finally:
        a.stop()
        peer.kill()
        peer.wait()
    records = read_records(tmp_path)
    assert [r["rank"] for r in records] == [0] and records[0]["ranks"] == [1]
    line = partition_line(records)
    assert line is not None and line.startswith("hvdrun: error: network partition: rank 0")
    assert json.loads((tmp_path / "unreachable.0.json").read_text())["message"] == a.failure.message


def test_a_store_that_closes_ends_the_watch_without_a_report(tmp_path) -> None:
    """Its host answered (connection closed or refused): the store's process ended, e.g. rank 0
    hosting it finished first. That is no partition; the other checks name a dead rank. The
    store runs in a process of its own, killed here as that rank's would be (a TCPStore server
    destroyed inside this process while threads are in calls on it: see the ``server`` fixture)."""
    exits = _Exits()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _STORE, str(port)], stdout=subprocess.PIPE, text=True)
    # A watch's store calls time out after half its timeout, and a call that fails ends the watch
    # as "store gone": with 1 s, a loaded CI machine's 0.5 s stall once ended a watch before the
    # other had seen it (the wait below failed). 4 s leaves 2 s per call.
    a = _watch(port, 0, tmp_path, exits, prefix="gone", timeout=4.0)
    b = _watch(port, 1, tmp_path, exits, prefix="gone", timeout=4.0)
    try:
        assert server.stdout.readline().strip() == "up"
        a.start(), b.start()
        assert _wait_for(lambda: 1 in a.peers)
        server.kill()  # the store's process ends: the next round fails at once
        server.wait()
        assert _wait_for(lambda: a.store_gone and b.store_gone)
        time.sleep(4.5)  # more than the timeout: still nothing reported
        assert a.failure is None and b.failure is None and exits.codes == []
    finally:
        a.stop(), b.stop()
        server.kill()
        server.wait()
        server.stdout.close()


_STORE = """
import signal, sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, True, timedelta(seconds=30),
                      wait_for_workers=False)
print("up", flush=True)
signal.pause()  # serve until the test kills this process
"""


def test_a_store_that_stalls_past_a_calls_timeout_keeps_the_watch_beating(tmp_path) -> None:
    """A store frozen for longer than one call's timeout (3 s of a 6 s watch) but less than the
    peer timeout: the timed-out call is silence, not a store that is gone; the beater connects
    again and the rounds go on once the store answers, with nothing reported."""
    exits = _Exits()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _STORE, str(port)], stdout=subprocess.PIPE, text=True)
    a = _watch(port, 0, tmp_path, exits, prefix="stall", timeout=6.0)
    b = _watch(port, 1, tmp_path, exits, prefix="stall", timeout=6.0)
    try:
        assert server.stdout.readline().strip() == "up"
        a.start(), b.start()
        assert _wait_for(lambda: 1 in a.peers and 0 in b.peers)
        os.kill(server.pid, signal.SIGSTOP)
        time.sleep(3.8)  # the fault's length: past a call's 3 s timeout, short of the 6 s silence
        os.kill(server.pid, signal.SIGCONT)
        thawed_at = a.clock.read()
        assert _wait_for(lambda: a.last_round_at > thawed_at and b.last_round_at > thawed_at, timeout=10)
        assert not a.store_gone and not b.store_gone
        assert a.failure is None and b.failure is None and exits.codes == []
    finally:
        a.stop(), b.stop()
        server.kill()
        server.wait()
        server.stdout.close()


def test_a_store_that_stops_answering_is_reported_as_cut_off(tmp_path) -> None:
    """A listener that accepts and never answers: what a cut link looks like from this side."""
    exits = _Exits()
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        a = _watch(port, 0, tmp_path, exits, prefix="cut")
        a.start()
        try:
            assert _wait_for(lambda: a.failure is not None, timeout=10)
            expected = f"rank 0 on {a.host} cannot reach the job's store at 127.0.0.1:{port}"
            assert a.failure.message.startswith(expected)
            assert _wait_for(lambda: exits.codes == [75], timeout=5)
        finally:
            a.stop()
    assert read_records(tmp_path)[0]["hosts"] == ["127.0.0.1"]


_FROZEN = """
import json, sys
from hvd_trainer.comm.world.heartbeat import PeerWatch
exits = []
watches = [PeerWatch(store_host="127.0.0.1", store_port=int(sys.argv[1]), key_prefix="frozen",
                     rank=r, size=2, timeout_seconds=1.0, hard_exit=exits.append) for r in (0, 1)]
for w in watches:
    w.start()
for line in sys.stdin:  # one report per line asked for
    print(json.dumps({"rounds": [w._count for w in watches], "exits": exits,
                      "failures": [w.failure.message if w.failure else None for w in watches]}), flush=True)
"""


def test_a_process_frozen_past_the_timeout_finds_nothing_once_it_runs_again(server) -> None:
    """Both ranks of a 1 s watch in one process, frozen 3 s (a paused VM, a starved process):
    nobody was heard from, but nobody could have been, so no failure once the process runs again
    and its watches have beaten and judged a few rounds (a watch on ``time.monotonic()`` reported
    rank 1 silent, or itself cut off, at its first judgement after the freeze)."""
    proc = subprocess.Popen([sys.executable, "-c", _FROZEN, str(server)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)

    def report() -> dict:
        proc.stdin.write("report\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    try:
        assert _wait_for(lambda: min(report()["rounds"]) >= 5)  # both beating, each seeing the other
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(3.0)  # the freeze's length: three timeouts
        os.kill(proc.pid, signal.SIGCONT)
        at_thaw = report()["rounds"]
        assert _wait_for(lambda: all(n >= t + 5 for n, t in zip(report()["rounds"], at_thaw, strict=True)))
        got = report()
        assert got["failures"] == [None, None] and got["exits"] == [], got
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()

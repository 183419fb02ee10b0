"""hvdrun's guarded rendezvous (hvd_trainer.launch.guarded_rdzv) on a real TCPStore in this process.

A joining agent with another secret or run id is refused before it writes anything, whatever a
stranger wrote into the public door mark; a second copy of a host's agent is refused; a complete
job without spares refuses a further agent, an elastic one lets it wait; an agent that finds no
host gives up at the start timeout; a rendezvous state not written with the job's secret is never
unpickled.
"""

from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import HashStore, PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError

from hvd_trainer.comm.world.world import free_port
from hvd_trainer.launch.errors import RendezvousEndedError, RendezvousRefusedError, RendezvousUnreachableError
from hvd_trainer.launch.guarded_rdzv import (
    UP_KEY,
    DoorRecord,
    SignedC10dBackend,
    _create_handler,
    _namespace,
    _state_key,
)


def _params(port: int, *, is_host: bool, run_id: str = "job-1", nodes: int = 1, local_addr: str | None = None,
            join_timeout: int = 10, **conf: int) -> RendezvousParameters:
    return RendezvousParameters(backend="hvdrun-c10d-test", endpoint=f"127.0.0.1:{port}", run_id=run_id,
                                min_nodes=nodes, max_nodes=nodes, is_host=is_host, join_timeout=join_timeout,
                                read_timeout=10, local_addr=local_addr, **conf)


def _join_in_a_thread(handler) -> tuple[threading.Thread, list[BaseException]]:
    """``handler.next_rendezvous()`` started in a thread, and the list its exception lands in."""
    raised: list[BaseException] = []

    def join() -> None:
        try:
            handler.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - the test asserts which one
            raised.append(exc)

    thread = threading.Thread(target=join)
    thread.start()
    return thread, raised


def _stranger(port: int) -> TCPStore:
    """A plain store client on the job's port: what anyone who reaches it can do."""
    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


@pytest.fixture
def hosted(monkeypatch):
    """A rendezvous hosted by this process for a one-host job with secret ``s3cret``, completed."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    port = free_port()
    handler = _create_handler(_params(port, is_host=True), secret="s3cret", spares=False)
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    yield port
    handler.shutdown()


def test_an_agent_with_another_secret_or_run_id_is_refused(hosted) -> None:
    for secret, run_id in (("wrong", "job-1"), (None, "job-1"), ("s3cret", "another-job")):
        with pytest.raises(RendezvousRefusedError, match="holds another secret"):
            _create_handler(_params(hosted, is_host=False, run_id=run_id), secret=secret, spares=True)


def test_a_complete_job_refuses_a_copy_unless_it_takes_spares(hosted) -> None:
    with pytest.raises(RendezvousRefusedError, match="already running with all its 1 host"):
        _create_handler(_params(hosted, is_host=False), secret="s3cret", spares=False)
    spare = _create_handler(_params(hosted, is_host=False), secret="s3cret", spares=True)
    assert spare.get_run_id() == "job-1"  # let in, to wait as a spare


def test_an_agent_meant_to_host_whose_port_is_taken_knocks_like_the_others(hosted) -> None:
    with pytest.raises(RendezvousRefusedError, match="holds another secret"):
        _create_handler(_params(hosted, is_host=True), secret="wrong", spares=False)
    # the same line again on the first host: its secret passes, but the port is the job's own
    with pytest.raises(RendezvousRefusedError, match="already hosts its rendezvous"):
        _create_handler(_params(hosted, is_host=True), secret="s3cret", spares=True)


def test_what_a_stranger_writes_at_the_door_turns_no_agent_of_the_job_away(hosted) -> None:
    stranger = _stranger(hosted)
    for junk in (b"\xff\xfe-not-utf8", b"0" * 64):
        stranger.set(UP_KEY, junk)
        assert _create_handler(_params(hosted, is_host=False), secret="s3cret", spares=True)
        with pytest.raises(RendezvousRefusedError, match="holds another secret"):
            _create_handler(_params(hosted, is_host=False), secret="wrong", spares=True)
    stranger.delete_key(UP_KEY)
    assert _create_handler(_params(hosted, is_host=False), secret="s3cret", spares=True)


def _waiting_spares(port: int, secret: str, run_id: str = "job-1") -> int:
    """Agents in the job's redundancy list, read from its signed state as an agent would."""
    store = PrefixStore(_namespace(secret, run_id), _stranger(port))
    found = SignedC10dBackend(store, run_id, key=_state_key(secret, run_id)).get_state()
    return 0 if found is None else len(pickle.loads(found[0]).redundancy_list)


def test_a_spare_waiting_when_the_job_ends_is_told_the_job_ended(monkeypatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    port = free_port()
    host = _create_handler(_params(port, is_host=True), secret="s", spares=True)
    host.next_rendezvous()
    record = DoorRecord()
    spare = _create_handler(_params(port, is_host=False), secret="s", spares=True, record=record)
    waiting, raised = _join_in_a_thread(spare)
    deadline = time.monotonic() + 20
    while _waiting_spares(port, "s") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _waiting_spares(port, "s") == 1
    host.shutdown()  # the job ended: torch closes its rendezvous
    waiting.join(timeout=20)
    assert len(raised) == 1 and isinstance(raised[0], RendezvousEndedError), raised
    assert record.endpoint == f"127.0.0.1:{port}" and not record.joined


def test_a_second_agent_on_one_host_is_refused_before_the_rendezvous_completes(monkeypatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    port = free_port()

    def agent(addr: str, *, is_host: bool = False, spares: bool = False):
        params = _params(port, is_host=is_host, nodes=3, local_addr=addr)
        return _create_handler(params, secret="s", spares=spares)

    host = agent("10.0.0.1", is_host=True)
    agent("10.0.0.2")
    with pytest.raises(RendezvousRefusedError, match=r"already runs on this host \(10.0.0.2\)"):
        agent("10.0.0.2")
    assert agent("10.0.0.2", spares=True)  # an elastic job takes a host that comes back: no claims
    assert host.get_run_id() == "job-1"


def test_an_agent_that_finds_no_host_gives_up_at_the_start_timeout() -> None:
    port = free_port()
    began = time.monotonic()
    with pytest.raises(RendezvousUnreachableError, match="nothing answered"):
        _create_handler(_params(port, is_host=False, join_timeout=2), secret="s", spares=False)
    assert time.monotonic() - began < 6
    bare = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))  # up, no door
    began = time.monotonic()
    with pytest.raises(RendezvousUnreachableError, match="no agent of the job opened it"):
        _create_handler(_params(port, is_host=False, join_timeout=2), secret="s", spares=False)
    assert 1.5 < time.monotonic() - began < 6
    del bare


def test_the_state_is_signed_and_a_foreign_one_is_not_unpickled() -> None:
    store = HashStore()
    backend = SignedC10dBackend(store, "job-1", key=b"k")
    state = pickle.dumps({"round": 3})
    stored, token, written = backend.set_state(state)
    assert written and stored == state
    assert backend.get_state() == (state, token)
    other = SignedC10dBackend(store, "job-1", key=b"another key")
    with pytest.raises(RendezvousStateError, match="not written with this job's secret"):
        other.get_state()
    store.set("torch.rendezvous.job-1", b"Z2FyYmFnZQ==")  # base64 of b"garbage", unsigned
    with pytest.raises(RendezvousStateError, match="not written with this job's secret"):
        backend.get_state()


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(addr)
    return found


def test_a_loopback_rendezvous_listens_on_loopback_only(hosted) -> None:
    assert _listening(hosted) == {"0100007F"}  # 127.0.0.1, nothing on every interface


def test_a_spare_that_ran_nothing_ends_0_and_any_other_lost_rendezvous_1(capsys) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from hvd_trainer.launch.runner import _report_lost_rendezvous

    waited = DoorRecord(endpoint="h1:29400", handler=object())  # type: ignore[arg-type]  # made, never joined
    assert _report_lost_rendezvous(RendezvousEndedError("closed"), waited, spares=True) == 0
    assert "waited as a spare (the job ended); nothing ran" in capsys.readouterr().err
    assert _report_lost_rendezvous(RendezvousConnectionError("gone"), waited, spares=True) == 0
    assert "(the job ended, or its first host stopped)" in capsys.readouterr().err
    assert _report_lost_rendezvous(RendezvousConnectionError("gone"), waited, spares=False) == 1
    waited.joined = True
    assert _report_lost_rendezvous(RendezvousConnectionError("gone"), waited, spares=True) == 1
    assert "could not start or finish: RendezvousConnectionError" in capsys.readouterr().err


def test_the_rounds_after_the_first_wait_the_rejoin_timeout(monkeypatch) -> None:
    """An elastic job's re-form waits longer than its start (``rejoin_timeout``: hvdrun's
    ``--elastic-timeout``, 600 s by default): torch keeps one join timeout for every round."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    handler = _create_handler(_params(free_port(), is_host=True, rejoin_timeout=77), secret="s", spares=True)
    assert handler._settings.timeout.join == timedelta(seconds=10)  # the first round: --start-timeout
    handler.next_rendezvous()
    assert handler._settings.timeout.join == timedelta(seconds=77)
    handler.shutdown()


NEVER_LOST = 3600
"""``keep_alive_max_attempt`` (heartbeats of 1 s) of an agent that judges nobody lost within a
test. Every agent of these tests lives in the test's process: when CI's load starves it for
seconds, the first thread to run again sees every heartbeat old, so only the agent whose
judgement a test asserts has a short limit."""


def _in_process_agents(port: int):
    """``agent(addr, ...)``: a handler of a 2-host in-process job on ``port`` (secret ``s``,
    heartbeats every second) that counts another agent lost ``lost_after`` s after its last one."""

    def agent(addr: str, *, is_host: bool = False, record: DoorRecord | None = None, join_timeout: int = 10,
              lost_after: int = NEVER_LOST):
        params = _params(port, is_host=is_host, nodes=2, local_addr=addr, in_process="true",
                         keep_alive_interval=1, keep_alive_max_attempt=lost_after, join_timeout=join_timeout)
        return _create_handler(params, secret="s", spares=True, record=record)
    return agent


def _formed(agent) -> tuple[object, object, dict[str, object]]:
    """Hosts ``10.0.0.1`` (the store's) and ``10.0.0.2`` joined as ranks 0 and 1."""
    h1, h2 = agent("10.0.0.1", is_host=True), agent("10.0.0.2")
    infos: dict[str, object] = {}
    joining = [threading.Thread(target=lambda n=n, h=h: infos.__setitem__(n, h.next_rendezvous()))
               for n, h in (("h1", h1), ("h2", h2))]
    for t in joining:
        t.start()
    for t in joining:
        t.join(timeout=30)
    assert [infos[n].rank for n in ("h1", "h2")] == [0, 1], infos
    return h1, h2, infos


def _await_err(capfd, needle: str, seconds: float = 20) -> str:
    """What the test's process wrote to stderr until ``needle`` appeared (or ``seconds`` passed)."""
    seen, deadline = "", time.monotonic() + seconds
    while needle not in seen and time.monotonic() < deadline:
        seen += capfd.readouterr().err
        time.sleep(0.05)
    return seen


def test_an_in_process_job_gives_a_lost_agents_place_to_an_agent_arriving_later(monkeypatch, capfd) -> None:
    """In-process recovery (``in_process``): an agent arriving at a running job waits while every
    agent is alive, then takes a lost agent's place (its rank, the round's size, the workers' store
    address) in the same round; the survivor sees nobody waiting for a new round (torch's agents
    would restart their workers for one)."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    agent = _in_process_agents(free_port())
    h1, h2, infos = _formed(agent)
    record = DoorRecord()
    # the spare counts an agent lost 5 s after its last heartbeat; it waits while both live, then
    # for h2's heartbeat to go stale: its own join deadline must outlast both
    spare = agent("10.0.0.3", record=record, join_timeout=60, lost_after=5)
    taken: list[object] = []
    arriving = threading.Thread(target=lambda: taken.append(spare.next_rendezvous()))
    arriving.start()
    assert "waits as a spare" in _await_err(capfd, "waits as a spare") and not taken and not record.joined
    h2._stop_heartbeats()  # h2's agent is lost: its heartbeat goes stale after 5 s
    arriving.join(timeout=30)
    assert len(taken) == 1 and record.joined
    info, first = taken[0], infos["h1"]
    assert (info.rank, info.world_size) == (1, 2)
    assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == (
        first.bootstrap_store_info.master_addr, first.bootstrap_store_info.master_port)
    assert "takes place 1 of 2 (that of 10.0.0.2)" in capfd.readouterr().err
    assert h1.num_nodes_waiting() == 0
    for handler in (spare, h1):
        handler.shutdown()


def test_a_spare_of_an_in_process_job_waits_while_it_runs_and_hears_when_it_ends(monkeypatch, capfd) -> None:
    """An agent arriving at a full in-process job whose agents all live waits as a spare for as
    long as the job runs, then ends with :class:`RendezvousEndedError` when the job's rendezvous
    closes."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    agent = _in_process_agents(free_port())
    h1, h2, _ = _formed(agent)
    waiting, raised = _join_in_a_thread(agent("10.0.0.4"))
    assert "waits as a spare" in _await_err(capfd, "waits as a spare") and not raised
    for handler in (h2, h1):
        handler.shutdown()
    waiting.join(timeout=20)
    assert len(raised) == 1 and isinstance(raised[0], RendezvousEndedError), (raised, capfd.readouterr().err)

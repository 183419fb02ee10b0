"""hvdrun's guarded rendezvous (hvd_trainer.launch.guarded_rdzv) on a real TCPStore in this process.

A joining agent with another secret or run id is refused before it writes anything; a complete
job without spares refuses a further agent, an elastic one lets it wait; a rendezvous state not
written with the job's secret is never unpickled.
"""

from __future__ import annotations

import pickle

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError

from hvd_trainer.comm.world.world import free_port
from hvd_trainer.launch.errors import RendezvousRefusedError
from hvd_trainer.launch.guarded_rdzv import SignedC10dBackend, _create_handler, admission_tag


def _params(port: int, *, is_host: bool, run_id: str = "job-1", nodes: int = 1) -> RendezvousParameters:
    return RendezvousParameters(backend="hvdrun-c10d-test", endpoint=f"127.0.0.1:{port}", run_id=run_id,
                                min_nodes=nodes, max_nodes=nodes, is_host=is_host, join_timeout=10,
                                read_timeout=10)


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


def test_admission_tag_depends_on_secret_run_id_and_nonce() -> None:
    base = admission_tag("s", "r", "n")
    assert len(base) == 64
    assert len({base, admission_tag("t", "r", "n"), admission_tag("s", "q", "n"),
                admission_tag("s", "r", "m"), admission_tag(None, "r", "n")}) == 5


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

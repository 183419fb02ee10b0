"""``hvd_trainer.run(fn, args, kwargs, np)``: horovod.run's results by rank, errors with the rank."""

from __future__ import annotations

import os

import pytest
import torch

import hvd_trainer as hvd
from hvd_trainer.launch.run_fn import RunError
from tests.e2e.hvdrun_helpers import ROOT, clean_env

RankResult = tuple[tuple[int, float, str], int]
"""What each rank of the shared job returns: ``_sum_and_rank``'s result, the closure's value."""


def _use_plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the test environment (clean_env): no launcher variables from an outer job."""
    for key in list(os.environ):
        monkeypatch.delenv(key)
    for key, value in clean_env().items():
        monkeypatch.setenv(key, value)


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    _use_plain_env(monkeypatch)


def _sum_and_rank(x: float, scale: int = 1) -> tuple[int, float, str]:
    hvd.init()
    total = hvd.allreduce(torch.tensor([x * (hvd.rank() + 1)]), op=hvd.Sum).item()
    return hvd.rank() * scale, total, os.environ["HOROVOD_RANK"]


@pytest.fixture(scope="module")
def three_ranks() -> list[RankResult]:
    """One successful job for both tests below (each launch costs seconds): a lambda closing
    over the caller's ``offset``, given args and kwargs; each rank returns ``_sum_and_rank``'s
    result and the closure's value. Module-scoped, so it sets the plain environment itself."""
    offset = 7
    with pytest.MonkeyPatch.context() as monkeypatch:
        _use_plain_env(monkeypatch)
        return hvd.run(lambda x, scale=1: (_sum_and_rank(x, scale), offset + int(os.environ["RANK"])),
                       args=(2.0,), kwargs={"scale": 10}, np=3, timeout_seconds=120)


def test_results_in_rank_order(three_ranks: list[RankResult]) -> None:
    got = [summed for summed, _ in three_ranks]
    assert got == [(0, 12.0, "0"), (10, 12.0, "1"), (20, 12.0, "2")]


def test_a_closure_from_the_caller_runs_too(three_ranks: list[RankResult]) -> None:
    assert [closed for _, closed in three_ranks] == [7, 8, 9]


def _fails_on_rank_1() -> None:
    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("missing column 'label'")
    hvd.allreduce(torch.ones(1))  # rank 0 waits for rank 1, which never comes


def test_error_names_the_rank_and_keeps_its_traceback() -> None:
    with pytest.raises(RunError, match=r"rank 1 raised KeyError: \"missing column 'label'\"") as info:
        hvd.run(_fails_on_rank_1, np=2, timeout_seconds=120)
    assert info.value.rank == 1
    assert "_fails_on_rank_1" in str(info.value)  # rank 1's traceback


def test_unsupported_arguments_say_what_to_use() -> None:
    with pytest.raises(ValueError, match="HINT: for several hosts use the hvdrun command"):
        hvd.run(print, np=2, hosts="node1:2,node2:2")
    with pytest.raises(ValueError, match="hvdrun --min-np/--max-np"):
        hvd.run(print, np=2, min_np=1)
    assert str(ROOT) in os.environ["PYTHONPATH"]


def _port_is_taken() -> bool:
    """Whether binding the job's store port fails here, before any rank has called init()."""
    import errno
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def test_the_store_port_is_held_before_the_ranks_start() -> None:
    """The caller binds the store's port before starting the ranks and holds it, so another
    program cannot take it between the choice and rank 0's init (a CI run failed that way:
    EADDRINUSE in rank 0's TCPStore). A port only chosen, not held, would bind here."""
    assert hvd.run(_port_is_taken, np=1, timeout_seconds=120) == [True]

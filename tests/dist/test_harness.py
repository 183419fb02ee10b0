"""The rank-process harness itself (``tests/multiproc.py``): a run with a hung rank fails before
its timeout, names the rank, shows where it hung (its threads' stacks) and keeps the other ranks'
errors."""

from __future__ import annotations

import threading

import pytest

from tests.multiproc import run_workers


def _rank() -> int:
    import hvd_trainer as hvd

    return hvd.rank()


def _rank0_hangs_rank1_raises() -> None:
    import hvd_trainer as hvd

    if hvd.rank() == 0:
        threading.Event().wait()  # never set: this rank hangs
    raise RuntimeError("rank 1 gave up first")


def test_a_hung_rank_names_where_it_hung_and_the_others_errors_are_kept() -> None:
    assert run_workers(_rank, 2) == [0, 1]  # rank processes started and imported: the clock is the run's
    with pytest.raises(AssertionError) as failure:
        run_workers(_rank0_hangs_rank1_raises, 2, timeout_seconds=12)
    message = str(failure.value)
    assert message.startswith("ranks died without a result: exit codes {0: 1}"), message
    assert "--- rank 1 ---" in message and "rank 1 gave up first" in message, message
    stacks = message.split("--- rank 0: stacks 5 s before the timeout ---", 1)[1]
    assert "Timeout (0:00:0" in stacks and "in _rank0_hangs_rank1_raises" in stacks, message

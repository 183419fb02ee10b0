"""Ranks stay in step after a local error, on 2 gloo processes.

A rank whose own argument check rejects a collective (here: ``op=Average`` of a bool tensor,
on that rank only) still consumes the collective's sequence number with a "skipped" entry.
When every rank raised at the same call, they all carry on in step; when only one did, both
ranks raise a CollectiveMismatchError naming the rank that skipped, within seconds, and no
later collective is paired with the wrong one.
"""

from __future__ import annotations

import time

import torch

from tests.multiproc import run_workers


def _attempt(call) -> tuple[str, str, float]:
    """(outcome, message, seconds): outcome is the exception class name or ``"ok:<value>"``."""
    t0 = time.monotonic()
    try:
        value = call()
        return f"ok:{value.tolist()}", "", time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - the test reports which error came back
        return type(exc).__name__, str(exc), time.monotonic() - t0


def _in_step() -> dict:
    import hvd_trainer as hvd

    r = hvd.rank()
    flags = torch.tensor([True, False])
    out: dict = {}
    # both ranks reject the same call locally: they stay in step
    out["both_bad"] = _attempt(lambda: hvd.allreduce(flags, op=hvd.Average, name="both_bad"))
    out["after_both"] = _attempt(lambda: hvd.allreduce(torch.full((2,), r + 1.0), op=hvd.Sum,
                                                       name="after_both"))
    # only rank 1 rejects its call; rank 0 starts a valid allreduce with the same name
    bad = flags if r == 1 else torch.ones(2)
    out["one_bad"] = _attempt(lambda: hvd.allreduce(bad, op=hvd.Average, name="one_bad"))
    out["next"] = _attempt(lambda: hvd.allreduce(torch.full((2,), r + 1.0), op=hvd.Sum, name="next"))
    # the silent-pairing case: rank 1's next call has the signature of rank 0's pending one
    same = torch.full((2,), r + 1.0)
    if r == 1:
        out["first"] = _attempt(lambda: hvd.allreduce(same, op=hvd.Sum, name="same", compression="int16"))
    else:
        out["first"] = _attempt(lambda: hvd.allreduce(same, op=hvd.Sum, name="same"))
    out["second"] = _attempt(lambda: hvd.allreduce(same, op=hvd.Sum, name="same"))
    # the movement collectives too: rank 1's splits do not add up to its rows
    rows = torch.ones(2, 1)
    out["a2a"] = _attempt(lambda: hvd.alltoall(rows, splits=[1, 5] if r == 1 else [1, 1], name="a2a")[0])
    out["after_a2a"] = _attempt(lambda: hvd.allreduce(torch.full((2,), r + 1.0), op=hvd.Sum, name="x"))
    return out


def _blocked() -> dict:
    """Rank 0 is already inside the transport (its signature is cached) when rank 1 skips."""
    import hvd_trainer as hvd

    r = hvd.rank()
    y = torch.full((3,), r + 1.0)
    for _ in range(3):
        hvd.allreduce(y, op=hvd.Sum, name="steady")
    if r == 1:
        out = {"steady": _attempt(lambda: hvd.allreduce(torch.tensor([True, False, True]),
                                                        op=hvd.Average, name="steady"))}
    else:  # exactly the cached signature: rank 0 goes straight into the transport
        out = {"steady": _attempt(lambda: hvd.allreduce(y, op=hvd.Sum, name="steady"))}
    out["after"] = _attempt(lambda: hvd.allreduce(y, op=hvd.Sum, name="steady"))
    return out


def test_ranks_stay_in_step_after_local_errors() -> None:
    results = run_workers(_in_step, 2, env={"HVD_TEST_PG_TIMEOUT": "60"}, timeout_seconds=120)
    for rank, res in enumerate(results):
        kind, text, _ = res["both_bad"]
        assert kind == "CommTypeError" and "bool" in text, (rank, res["both_bad"])
        assert res["after_both"][0] == "ok:[3.0, 3.0]", (rank, res["after_both"])
        kind, text, seconds = res["one_bad"]
        assert kind == "CollectiveMismatchError", (rank, res["one_bad"])
        assert "'one_bad'" in text and "rank 1 skipped allreduce 'one_bad'" in text, (rank, text)
        assert "rank 0 = \"allreduce\", rank 1 = \"skipped\"" in text, (rank, text)
        assert seconds < 30, (rank, seconds)
        # the ranks are in step again: the next collective pairs correctly
        assert res["next"][0] == "ok:[3.0, 3.0]", (rank, res["next"])
        # each rank's first call fails (rank 1's with its own error attached); the second
        # calls pair with each other, never rank 0's first with rank 1's second
        kind, text, seconds = res["first"]
        assert kind == "CollectiveMismatchError" and "rank 1 skipped allreduce 'same'" in text, (rank, text)
        assert seconds < 30, (rank, seconds)
        assert res["second"][0] == "ok:[3.0, 3.0]", (rank, res["second"])
        kind, text, seconds = res["a2a"]
        assert kind == "CollectiveMismatchError" and "rank 1 skipped alltoall 'a2a'" in text, (rank, text)
        assert seconds < 30 and res["after_a2a"][0] == "ok:[3.0, 3.0]", (rank, res["after_a2a"])
    assert "rank 1's own error: " in results[1]["first"][1], results[1]["first"]

def test_rank_blocked_in_transport_sees_the_skip() -> None:
    results = run_workers(_blocked, 2, env={"HVD_TEST_PG_TIMEOUT": "60"}, timeout_seconds=120)
    for rank, res in enumerate(results):
        kind, text, seconds = res["steady"]
        assert kind == "CollectiveMismatchError" and "rank 1 skipped allreduce 'steady'" in text, (rank, text)
        assert seconds < 30, (rank, seconds)
        # rank 0's collective is left half-finished in the transport: every later collective
        # raises on every rank (never pairs rank 1's next call with rank 0's pending one)
        kind, text, seconds = res["after"]
        assert kind == "CollectiveMismatchError" and "out of step" in text, (rank, res["after"])
        assert seconds < 30, (rank, res["after"])

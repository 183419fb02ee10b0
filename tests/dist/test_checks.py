"""Cross-rank checks on 2 gloo processes: every mismatch raises CollectiveMismatchError on both
ranks, naming the tensor and each rank's value, within the timeout; a missing rank is reported
as a stall naming it and the collective.

Mismatches found by the signature check leave no collective half-done, so one spawned run
walks through all of them and proves the job still works afterwards; the case where one rank
is already blocked in the transport comes last (it leaves that collective unfinished).
"""

from __future__ import annotations

import time
import warnings

import torch

from tests.multiproc import run_workers


def _cases(hvd, r: int) -> list[tuple[str, object]]:
    """(label, callable) pairs; each callable makes rank-dependent, mismatching calls."""
    x = torch.ones(3)
    return [
        ("shape", lambda: hvd.allreduce(torch.ones(2, 3) if r == 0 else torch.ones(3, 2), name="w_shape")),
        ("dtype", lambda: hvd.allreduce(x if r == 0 else x.long(), name="w_dtype")),
        ("op", lambda: hvd.allreduce(x, op=hvd.Sum if r == 0 else hvd.Max, name="w_op")),
        ("root", lambda: hvd.broadcast(x, root_rank=r, name="w_root")),
        ("trailing", lambda: hvd.allgather(torch.ones(2, 3 + r), name="w_gather")),
        ("splits", lambda: hvd.alltoall(torch.ones(2, 1), splits=[1, 1] if r == 0 else None, name="w_a2a")),
        ("name", lambda: hvd.allreduce(x, name=f"w_name_{r}")),
        ("order", lambda: hvd.allreduce(x, name="w_first") if r == 0 else hvd.allgather(x, name="w_second")),
        ("grouped", lambda: hvd.grouped_allreduce([x, torch.ones(2 + r)], name="w_group")),
        ("process_set", lambda: hvd.ProcessSet([r])),  # new_group order/ranks must agree
    ]


def _mismatches() -> dict:
    import hvd_trainer as hvd

    r = hvd.rank()
    out: dict = {}
    for label, call in _cases(hvd, r):
        t0 = time.monotonic()
        try:
            call()
            out[label] = ("no error", 0.0)
        except hvd.CollectiveMismatchError as exc:
            out[label] = (str(exc), time.monotonic() - t0)
    # the job is still healthy: varying dim 0 in allgather is legal, sums are right
    out["after_gather"] = hvd.allgather(torch.full((r + 1, 2), r), name="ok").shape[0]
    out["after_sum"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="ok_sum").tolist()
    # one rank blocked in the transport (signature cached), the other checking a new one
    y = torch.ones(4)
    for _ in range(3):
        hvd.allreduce(y, name="steady")
    t0 = time.monotonic()
    try:
        hvd.allreduce(y if r == 0 else torch.ones(5), name="steady")
        out["blocked"] = ("no error", 0.0)
    except hvd.CollectiveMismatchError as exc:
        out["blocked"] = (str(exc), time.monotonic() - t0)
    return out


EXPECTED_TEXT = {
    "shape": ["'w_shape'", "shape", "[2, 3]", "[3, 2]"],
    "dtype": ["'w_dtype'", "torch.float32", "torch.int64"],
    "op": ["'w_op'", "SUM", "MAX"],
    "root": ["'w_root'", "root_rank", "rank 0 = 0", "rank 1 = 1"],
    "trailing": ["'w_gather'", "trailing_shape", "[3]", "[4]"],
    "splits": ["'w_a2a'", "splits_given", "true", "false"],
    "name": ["w_name_0", "w_name_1"],
    "order": ["w_first", "w_second", "allreduce", "allgather"],
    "grouped": ["w_group", "shapes"],
    "process_set": ["process_set#1", "ranks", "rank 0 = [0], rank 1 = [1]"],
    "blocked": ["'steady'", "[4]", "[5]"],
}


def test_mismatch_errors_on_every_rank() -> None:
    results = run_workers(_mismatches, 2, env={"HVD_TEST_PG_TIMEOUT": "60"}, timeout_seconds=120)
    for res in results:
        for label, needles in EXPECTED_TEXT.items():
            text, seconds = res[label]
            assert text != "no error", label
            assert seconds < 30, (label, seconds)
            assert "rank 0 = " in text and "rank 1 = " in text and "HINT" in text, (label, text)
            for needle in needles:
                assert needle in text, (label, needle, text)
        assert res["after_gather"] == 3 and res["after_sum"] == [2.0]


def _stall() -> dict:
    import hvd_trainer as hvd

    r = hvd.rank()
    y = torch.ones(2)
    for _ in range(3):
        hvd.allreduce(y, name="grads")  # the signature is cached from here on
    if r == 1:
        time.sleep(6)  # "stuck in compute": never reaches the next allreduce in time
        return {}
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            hvd.allreduce(y, name="grads")
            return {"error": "no error"}
        except hvd.StallError as exc:
            return {"error": str(exc), "seconds": time.monotonic() - t0,
                    "warnings": [str(w.message) for w in caught]}


def test_stall_names_missing_rank_and_collective() -> None:
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    res = run_workers(_stall, 2, env=env, timeout_seconds=90)[0]
    assert "rank(s) [1]" in res["error"] and "'grads'" in res["error"], res
    assert 3 <= res["seconds"] < 10, res["seconds"]
    assert any("rank(s) [1]" in w and "'grads'" in w for w in res["warnings"]), res["warnings"]


def _duplicates() -> dict:
    import hvd_trainer as hvd

    r = hvd.rank()
    t = torch.full((3,), float(r + 1))
    out: dict = {"errors": []}
    first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
    calls = [
        lambda: hvd.allreduce_async(t, name="dup"),
        lambda: hvd.allreduce(t, name="dup"),
    ]
    t0 = time.monotonic()
    for call in calls:
        try:
            call()
            out["errors"].append("no error")
        except ValueError as exc:  # Horovod raises ValueError here too
            out["errors"].append(f"{type(exc).__name__}: {exc}")
    out["seconds"] = time.monotonic() - t0
    # another kind may use the same name; the first handle still completes correctly
    out["gathered"] = hvd.allgather(t[:1], name="dup").tolist()
    out["first"] = hvd.synchronize(first).tolist()
    b = hvd.broadcast_async(t, 1, name="dup_b")
    try:
        hvd.broadcast_async(t, 1, name="dup_b")
        out["bcast_error"] = "no error"
    except ValueError as exc:
        out["bcast_error"] = str(exc)
    out["bcast"] = hvd.synchronize(b).tolist()
    # once synchronized, the name is free again and the ranks are still in step
    out["again"] = hvd.allreduce(t, name="dup", op=hvd.Sum).tolist()
    return out


def test_duplicate_name_in_flight_raises_at_once() -> None:
    for res in run_workers(_duplicates, 2, timeout_seconds=90):
        assert len(res["errors"]) == 2
        for text in res["errors"]:
            assert text.startswith("DuplicateNameError: ") and "'dup'" in text, text
            assert "allreduce.dup" in text and "HINT" in text, text
        assert res["seconds"] < 1.0, res["seconds"]
        assert "allreduce.dup" not in res["bcast_error"] and "broadcast.dup_b" in res["bcast_error"]
        assert res["gathered"] == [1.0, 2.0]
        assert res["first"] == [3.0, 3.0, 3.0] and res["again"] == [3.0, 3.0, 3.0]
        assert res["bcast"] == [2.0, 2.0, 2.0]

"""Named async collectives matched by name across ranks (``hvd_trainer.comm.ops.by_name``), on
2 and 3 gloo processes, against closed-form per-rank values.

Horovod's own duplicate-name tests start a named collective on rank 0, pass a ``barrier()``, and
only then start it on the other ranks; ranks may also start differently named collectives in
different orders. Matching by name is opt-in (``HVD_TRAINER_MATCH_ASYNC_NAMES=1``); with the
default, matching by call order, the same program raises a mismatch, which the last test shows.
"""

from __future__ import annotations

import time
import warnings

import torch

from tests.multiproc import run_workers

BY_NAME = {"HVD_TRAINER_MATCH_ASYNC_NAMES": "1"}


def _horovod_duplicate_names() -> dict:
    """Horovod's test_horovod_*_duplicate_name_error, for each kind, plus the values."""
    import hvd_trainer as hvd

    r, n = hvd.rank(), hvd.size()
    t = torch.full((4, 3), float(r + 1))
    starts = {
        "allreduce": lambda: hvd.allreduce_async(t, name="duplicate_name", op=hvd.Sum),
        "allgather": lambda: hvd.allgather_async(t[: r + 1], name="duplicate_name"),
        "broadcast": lambda: hvd.broadcast_async(t, n - 1, name="duplicate_name"),
        "alltoall": lambda: hvd.alltoall_async(t[: 2 * n].reshape(2 * n, -1)[:n], name="duplicate_name"),
        "reducescatter": lambda: hvd.reducescatter_async(t[:n], name="duplicate_name", op=hvd.Sum),
    }
    out: dict = {}
    for kind, start in starts.items():
        handles, errors = [], []
        for first in (True, False):
            if (r == 0) == first:
                handles.append(start())
                try:
                    start()
                    errors.append("no error")
                except ValueError as exc:  # Horovod: (torch.FatalError, ValueError)
                    errors.append(type(exc).__name__)
            hvd.barrier()
        result = hvd.synchronize(handles[0])
        out[kind] = (errors, (result[0] if kind == "alltoall" else result).tolist())
    return out


def test_horovods_duplicate_name_tests_pass_and_the_collectives_complete() -> None:
    for res in run_workers(_horovod_duplicate_names, 2, env=BY_NAME, timeout_seconds=120):
        for kind, (errors, _) in res.items():
            assert errors == ["DuplicateNameError"], (kind, errors)
        assert res["allreduce"][1] == [[3.0] * 3] * 4
        assert res["allgather"][1] == [[1.0] * 3] + [[2.0] * 3] * 2
        assert res["broadcast"][1] == [[2.0] * 3] * 4
        assert res["alltoall"][1] == [[1.0] * 3, [2.0] * 3]
        assert res["reducescatter"][1] == [[3.0] * 3]


def _orders() -> dict:
    """Each rank starts the same names in its own order; a process set matches on its own."""
    import hvd_trainer as hvd

    r, n = hvd.rank(), hvd.size()
    names = ["a", "b", "c"]
    order = names[r:] + names[:r]  # rank 0: a b c, rank 1: b c a, rank 2: c a b
    value = {name: torch.full((2,), float(10 * i + r)) for i, name in enumerate(names)}
    handles = {name: hvd.allreduce_async(value[name], name=name, op=hvd.Sum) for name in order}
    pair = hvd.add_process_set([0, 1])
    gathered = None
    if pair.included():
        later = ["y", "x"] if r == 0 else ["x", "y"]
        gh = {k: hvd.allgather_async(torch.tensor([float(r)]), name=k, process_set=pair) for k in later}
        gathered = {k: hvd.synchronize(h).tolist() for k, h in gh.items()}
    # the same names again, synchronized in yet another order, once the first ones are done
    sums = {name: hvd.synchronize(handles[name]).tolist() for name in reversed(names)}
    again = {name: hvd.allreduce_async(value[name], name=name) for name in reversed(order)}
    averages = {name: hvd.synchronize(h).tolist() for name, h in again.items()}
    hvd.remove_process_set(pair)
    return {"sums": sums, "averages": averages, "gathered": gathered, "n": n,
            "polled_done": all(hvd.poll(h) for h in handles.values())}


def test_names_match_whatever_the_order_on_each_rank() -> None:
    results = run_workers(_orders, 3, env=BY_NAME, timeout_seconds=150)
    for r, res in enumerate(results):
        n = res["n"]
        total = sum(range(n))
        for i, name in enumerate("abc"):
            assert res["sums"][name] == [10.0 * i * n + total] * 2, (name, res)
            assert res["averages"][name] == [10.0 * i + total / n] * 2, (name, res)
        assert res["gathered"] == ({"x": [0.0, 1.0], "y": [0.0, 1.0]} if r < 2 else None)
        assert res["polled_done"]


def _mismatch_and_stall() -> dict:
    import hvd_trainer as hvd

    r = hvd.rank()
    out: dict = {}
    h = hvd.allreduce_async(torch.ones(2 + r), name="shape_differs")
    try:
        hvd.synchronize(h)
        out["mismatch"] = "no error"
    except hvd.CollectiveMismatchError as exc:
        out["mismatch"] = str(exc)
    out["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist()  # the ordered stream is fine
    if r == 0:
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="only_rank0"))
                out["stall"] = "no error"
            except hvd.StallError as exc:
                out["stall"] = str(exc)
        out["stall_seconds"] = time.monotonic() - t0
        out["warnings"] = [str(w.message) for w in caught]
    hvd.barrier()
    return out


def test_mismatch_raises_on_every_rank_and_a_missing_rank_is_named() -> None:
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3", **BY_NAME}
    res = run_workers(_mismatch_and_stall, 2, env=env, timeout_seconds=90)
    for one in res:
        assert "'shape_differs'" in one["mismatch"] and "shape" in one["mismatch"], one["mismatch"]
        assert one["after"] == [2.0]
    stall = res[0]
    assert "rank(s) [1]" in stall["stall"] and "'only_rank0'" in stall["stall"], stall
    assert "matched by name" in stall["stall"] and "HINT" in stall["stall"], stall
    assert 3 <= stall["stall_seconds"] < 10, stall["stall_seconds"]
    assert any("rank(s) [1]" in w and "only_rank0" in w for w in stall["warnings"]), stall["warnings"]


def _rank0_first() -> dict:
    import hvd_trainer as hvd

    r = hvd.rank()
    try:
        h = hvd.allreduce_async(torch.ones(1), name="late") if r == 0 else None
        hvd.barrier()
        if r == 1:
            h = hvd.allreduce_async(torch.ones(1), name="late")
        hvd.synchronize(h)
        return {"error": None}
    except hvd.CollectiveMismatchError as exc:
        return {"error": str(exc)}


def test_matching_by_call_order_by_default() -> None:
    for res in run_workers(_rank0_first, 2, timeout_seconds=90):
        assert res["error"] is not None and "barrier" in res["error"], res

"""Named async collectives matched by name across ranks (``hvd_trainer.comm.ops.by_name``), on
2 and 3 gloo processes, against closed-form per-rank values.

Horovod's own duplicate-name tests start a named collective on rank 0, pass a ``barrier()``, and
only then start it on the other ranks; ranks may also start differently named collectives in
different orders; a rank inside ``join()`` adds zeros to the others' named allreduces.
Matching by name is the default; with ``HVD_TRAINER_MATCH_ASYNC_NAMES=0`` (call order) the same
program raises a mismatch, which the last test shows.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from tests.multiproc import run_workers

BY_NAME: dict[str, str] = {}
"""The default: matched by name."""
BY_CALL_ORDER = {"HVD_TRAINER_MATCH_ASYNC_NAMES": "0"}


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


def test_matching_by_call_order_when_turned_off() -> None:
    for res in run_workers(_rank0_first, 2, env=BY_CALL_ORDER, timeout_seconds=90):
        assert res["error"] is not None and "barrier" in res["error"], res


def _join_with_named() -> dict:
    """Horovod's test_horovod_join_allreduce (two named async allreduces while a rank is
    joined, with and without the same names used before), on 3 ranks, then an allgather by name
    while a rank is joined (an error on its callers only), then names used again after."""
    import hvd_trainer as hvd

    r, n = hvd.rank(), hvd.size()
    out: dict = {"rounds": [], "gather_error": None}
    for first_join, caching in [(0, False), (1, True), (2, True), (0, True)]:
        a, b = torch.full((5,), float(r + 1)), torch.full((17, 2), float(10 * (r + 1)))
        cached = None
        if caching:  # every rank uses the names once before someone joins
            ha = hvd.allreduce_async(a, name="tensor_a", op=hvd.Sum)
            hb = hvd.allreduce_async(b, name="tensor_b", op=hvd.Sum)
            cached = [hvd.synchronize(ha)[0].item(), hvd.synchronize(hb)[0, 0].item()]
        if r == first_join:
            last = hvd.join()
            got = None
        else:
            # started in different orders on the active ranks
            order = ["tensor_b", "tensor_a"] if r % 2 else ["tensor_a", "tensor_b"]
            hs = {k: hvd.allreduce_async({"tensor_a": a, "tensor_b": b}[k], name=k) for k in order}
            got = [hvd.synchronize(hs["tensor_a"])[0].item(), hvd.synchronize(hs["tensor_b"])[0, 0].item()]
            last = hvd.join()
        out["rounds"].append({"first_join": first_join, "cached": cached, "got": got, "last": last})
    if r == 1:
        hvd.join()
    else:
        try:
            hvd.synchronize(hvd.allgather_async(torch.ones(1), name="gathered"))
        except hvd.JoinedRankError as exc:
            out["gather_error"] = str(exc)
        hvd.join()
    again = hvd.allreduce_async(torch.tensor([float(r)]), name="tensor_a", op=hvd.Sum)
    out["after"] = hvd.synchronize(again).tolist()
    out["n"] = n
    return out


def test_a_joined_rank_adds_zeros_to_named_allreduces() -> None:
    for r, res in enumerate(run_workers(_join_with_named, 3, timeout_seconds=150)):
        n = res["n"]
        for one in res["rounds"]:
            j = one["first_join"]
            if one["cached"] is not None:
                assert one["cached"] == [n * (n + 1) / 2, 10 * n * (n + 1) / 2], one
            if r == j:
                assert one["got"] is None
            else:  # the average over all n ranks, the joined rank adding zeros
                active = [q + 1 for q in range(n) if q != j]
                assert one["got"] == pytest.approx([sum(active) / n, 10 * sum(active) / n], rel=1e-6), one
            assert one["last"] in [q for q in range(n) if q != j], one
        if r == 1:
            assert res["gather_error"] is None
        else:
            assert "allgather 'gathered'" in res["gather_error"] and "join()" in res["gather_error"], res
        assert res["after"] == [float(sum(range(n)))]

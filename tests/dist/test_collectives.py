"""Every collective on 2 and 3 gloo processes against closed-form per-rank values.

One spawned run per world size carries all the checks (spawning costs seconds); the 2-process
run also writes a timeline (``HOROVOD_TIMELINE``) that is validated afterwards.
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch

from tests.multiproc import run_workers


def _reductions(hvd, r: int, n: int) -> dict:
    x = torch.full((3,), float(r + 1))
    y = x.clone()
    hvd.allreduce_(y, op=hvd.Sum)
    h = hvd.allreduce_async(x, op=hvd.Sum, name="async_sum")
    polled = hvd.poll(h)
    out = {
        "avg": hvd.allreduce(x, name="a1").tolist(),
        "sum": hvd.allreduce(x, op=hvd.Sum).tolist(),
        "min": hvd.allreduce(x, op=hvd.Min).tolist(),
        "max": hvd.allreduce(x, op=hvd.Max).tolist(),
        "prod": hvd.allreduce(x, op=hvd.Product).tolist(),
        "x_unchanged": x.tolist(),
        "inplace": y.tolist(),
        "async": hvd.synchronize(h).tolist(),
        "polled_is_bool": isinstance(polled, bool) and hvd.poll(h),
        "scaled": hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25).tolist(),
        "int_avg": hvd.allreduce(torch.tensor([r * 3 + 1]), name="ints").tolist(),
        "neg_int_avg": hvd.allreduce(torch.tensor([-(r * 3 + 1)]), name="negints").tolist(),
        "int_sum": hvd.allreduce(torch.tensor([r * 3 + 1]), op=hvd.Sum).tolist(),
        "fp16_avg": hvd.allreduce(torch.full((2,), 40000.0, dtype=torch.float16)).tolist(),
        "noncontig": hvd.allreduce(torch.arange(6.0).reshape(2, 3).t() * (r + 1), op=hvd.Sum).tolist(),
    }
    try:
        hvd.allreduce(torch.tensor([True]))
        out["bool_avg"] = "no error"
    except TypeError as exc:
        out["bool_avg"] = str(exc)
    return out


def _compression(hvd, r: int, n: int) -> dict:
    big = torch.tensor([1.0e6 * (r + 1), -3.0e5, 1.0e-3 * (r + 1), 0.0])
    return {
        "fp16": hvd.allreduce(big, compression=hvd.Compression.fp16, name="c16").tolist(),
        "bf16": hvd.allreduce(big, compression=hvd.Compression.bf16, name="cbf16").tolist(),
        "fp16_sum": hvd.allreduce(big, op=hvd.Sum, compression=hvd.Compression.fp16).tolist(),
        "fp16_dtype": str(hvd.allreduce(big, compression=hvd.Compression.fp16).dtype),
        "int_passthrough": hvd.allreduce(torch.tensor([r + 1]), op=hvd.Sum,
                                         compression=hvd.Compression.fp16).tolist(),
    }


def _grouped_and_moves(hvd, r: int, n: int) -> dict:
    a, b = torch.full((2, 2), float(r)), torch.full((3,), float(2 * r))
    c = torch.tensor([r, 10 * r])
    grouped = hvd.grouped_allreduce([a, b, c], op=hvd.Sum, name="g")
    a2, b2 = a.clone(), b.clone()
    hvd.grouped_allreduce_([a2, b2])
    alltoall_out, received = hvd.alltoall(torch.full((n * (r + 1), 2), float(r)), splits=[r + 1] * n)
    rows = n * 2 + 1
    rs = hvd.reducescatter(torch.arange(float(rows)).reshape(rows, 1) * (r + 1), op=hvd.Sum)
    return {
        "grouped": [t.tolist() for t in grouped],
        "grouped_dtypes": [str(t.dtype) for t in grouped],
        "grouped_inplace": [a2.tolist(), b2.tolist()],
        "gather": hvd.allgather(torch.full((r + 1, 2), r)).tolist(),
        "gather_empty_one": list(hvd.allgather(torch.ones((0 if r == 0 else 2, 3))).shape),
        "gather_all_empty": list(hvd.allgather(torch.ones((0, 3))).shape),
        "bcast": hvd.broadcast(torch.tensor([float(r)]), root_rank=n - 1).tolist(),
        "bcast_inplace": hvd.broadcast_(torch.tensor([r, r]), root_rank=0).tolist(),
        "alltoall": alltoall_out.tolist(),
        "received_splits": received.tolist(),
        "received_dtype": str(received.dtype),
        "alltoall_equal": hvd.alltoall(torch.arange(2.0 * n) + 100 * r).tolist(),
        "reducescatter": rs.flatten().tolist(),
        "rs_avg": hvd.reducescatter(torch.full((n, 2), float(r))).tolist(),
        "obj": hvd.broadcast_object({"rank": r}, root_rank=0),
        "objs": hvd.allgather_object({"r": r} if r == 0 else {"r": r, "extra": [r]}),
    }


def _process_sets(hvd, r: int, n: int) -> dict:
    evens = hvd.ProcessSet(range(0, n, 2))
    odds = hvd.ProcessSet(range(1, n, 2))
    mine = evens if evens.included() else odds
    x = torch.tensor([float(r + 1)])
    out = {
        "set_sum": hvd.allreduce(x, op=hvd.Sum, process_set=mine).tolist(),
        "set_gather": hvd.allgather(torch.tensor([r]), process_set=mine).tolist(),
        "set_bcast": hvd.broadcast(torch.tensor([r]), root_rank=mine.ranks[-1], process_set=mine).tolist(),
        "set_rank": mine.rank(),
        "set_size": mine.size(),
    }
    other = odds if mine is evens else evens
    try:
        hvd.allreduce(x, process_set=other)
        out["non_member"] = "no error"
    except ValueError as exc:
        out["non_member"] = str(exc)
    hvd.barrier(process_set=mine)
    hvd.barrier()
    return out


def _all_collectives() -> dict:
    import hvd_trainer as hvd

    r, n = hvd.rank(), hvd.size()
    out = {}
    for part in (_reductions, _compression, _grouped_and_moves, _process_sets):
        out.update(part(hvd, r, n))
    hvd.barrier()
    return out


def _check_reductions(res: dict, r: int, n: int) -> None:
    total = n * (n + 1) / 2
    assert res["avg"] == [total / n] * 3
    assert res["sum"] == [total] * 3 and res["inplace"] == [total] * 3 and res["async"] == [total] * 3
    assert res["min"] == [1.0] * 3 and res["max"] == [float(n)] * 3
    assert res["prod"] == [float(math.factorial(n))] * 3
    assert res["x_unchanged"] == [float(r + 1)] * 3
    assert res["polled_is_bool"] is True
    assert res["scaled"] == [total * 0.5] * 3
    int_total = sum(q * 3 + 1 for q in range(n))
    assert res["int_avg"] == [int_total // n]  # positive: floor == trunc
    assert res["neg_int_avg"] == [-(int_total // n)]  # rounded toward zero
    assert res["int_sum"] == [int_total]
    assert res["fp16_avg"] == [40000.0, 40000.0]  # divided before the fp16 sum: no inf
    assert res["noncontig"] == (torch.arange(6.0).reshape(2, 3).t() * total).tolist()
    assert "bool" in res["bool_avg"] and "HINT" in res["bool_avg"]


def _check_compression(res: dict, n: int) -> None:
    mean = [1.0e6 * (n + 1) / 2, -3.0e5, 1.0e-3 * (n + 1) / 2, 0.0]
    for key, rel in (("fp16", 1e-3), ("bf16", 1e-2)):
        for got, want in zip(res[key], mean, strict=True):
            # small entries share the wire scale of the largest one: absolute slack 1e-4
            assert math.isfinite(got) and abs(got - want) <= rel * abs(want) + 1e-4, (key, got, want)
    sums = [1.0e6 * n * (n + 1) / 2, -3.0e5 * n, 1.0e-3 * n * (n + 1) / 2, 0.0]
    for got, want in zip(res["fp16_sum"], sums, strict=True):
        assert math.isfinite(got) and abs(got - want) <= 1e-3 * abs(want) + 1e-4
    assert res["fp16_dtype"] == "torch.float32"
    assert res["int_passthrough"] == [n * (n + 1) // 2]


def _check_moves(res: dict, r: int, n: int) -> None:
    tri = n * (n - 1) / 2
    assert res["grouped"] == [[[tri] * 2] * 2, [2 * tri] * 3, [int(tri), int(10 * tri)]]
    assert res["grouped_dtypes"] == ["torch.float32", "torch.float32", "torch.int64"]
    assert res["grouped_inplace"] == [[[tri / n] * 2] * 2, [2 * tri / n] * 3]
    assert res["gather"] == [[q, q] for q in range(n) for _ in range(q + 1)]
    assert res["gather_empty_one"] == [2 * (n - 1), 3] and res["gather_all_empty"] == [0, 3]
    assert res["bcast"] == [float(n - 1)] and res["bcast_inplace"] == [0, 0]
    assert res["alltoall"] == [[float(q)] * 2 for q in range(n) for _ in range(q + 1)]
    assert res["received_splits"] == [q + 1 for q in range(n)]
    assert res["received_dtype"] == "torch.int32"
    assert res["alltoall_equal"] == [2.0 * r + j + 100 * q for q in range(n) for j in range(2)]
    rows = 2 * n + 1
    start = r * 2 + min(r, 1)
    block = list(range(start, start + 2 + (1 if r < 1 else 0)))
    assert rows == sum(2 + (1 if q < 1 else 0) for q in range(n))
    assert res["reducescatter"] == [float(i * n * (n + 1) / 2) for i in block]
    assert res["rs_avg"] == [[tri / n] * 2]
    assert res["obj"] == {"rank": 0}
    assert res["objs"] == [{"r": 0}] + [{"r": q, "extra": [q]} for q in range(1, n)]


def _check_sets(res: dict, r: int, n: int) -> None:
    members = list(range(r % 2, n, 2))
    assert res["set_sum"] == [float(sum(q + 1 for q in members))]
    assert res["set_gather"] == members
    assert res["set_bcast"] == [members[-1]]
    assert res["set_rank"] == members.index(r) and res["set_size"] == len(members)
    assert "not in process set" in res["non_member"] and "HINT" in res["non_member"]


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_closed_form(n: int, tmp_path) -> None:
    timeline = str(tmp_path / "timeline.json")
    results = run_workers(_all_collectives, n, env={"HOROVOD_TIMELINE": timeline}, timeout_seconds=150)
    for r, res in enumerate(results):
        _check_reductions(res, r, n)
        _check_compression(res, n)
        _check_moves(res, r, n)
        _check_sets(res, r, n)
    _check_timeline(timeline)


def _check_timeline(path: str) -> None:
    assert os.path.exists(path)
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)  # valid JSON (Chrome trace object format)
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    named = [e for e in events if e["args"]["tensor"] == "async_sum"]
    phases = {e["name"] for e in named}
    assert {"check", "queue", "allreduce", "wait"} <= phases, phases
    transport = next(e for e in named if e["name"] == "allreduce")
    assert transport["args"]["bytes"] == 12 and transport["dur"] >= 0 and transport["ts"] >= 0
    kinds = {e["name"] for e in events}
    assert {"allgather", "broadcast", "alltoall", "barrier", "grouped_allreduce"} <= kinds, kinds


def _live_timeline(path: str) -> dict:
    import hvd_trainer as hvd

    seen: dict = {}
    hvd.allreduce(torch.ones(3), name="live_sum", op=hvd.Sum)
    if hvd.rank() == 0:  # the job is still running: read the file as a user would
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and "allreduce.live_sum" not in seen.get("text", ""):
            with open(path, encoding="utf-8") as fh:
                seen["text"] = fh.read()
            time.sleep(0.02)
        seen["seconds_left"] = deadline - time.monotonic()
    hvd.barrier()
    return seen


def _parse_trace(text: str) -> list[dict]:
    """Our trace is an object that is closed after every write; Horovod's is an array left
    open. Accept both, as chrome://tracing does."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = json.loads(text.rstrip().rstrip(",") + "]")
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def test_timeline_readable_while_the_job_runs(tmp_path) -> None:
    path = str(tmp_path / "live.json")
    seen = run_workers(_live_timeline, 2, args=(path,), env={"HOROVOD_TIMELINE": path},
                       timeout_seconds=90)[0]
    assert seen["seconds_left"] > 0, "the allreduce did not reach the file within 1 s"
    events = _parse_trace(seen["text"])
    rows = {e["args"]["name"] for e in events if e.get("ph") == "M"}
    assert "allreduce.live_sum" in rows, rows
    mine = [e for e in events if e.get("ph") == "X" and e["args"]["tensor"] == "live_sum"]
    activities = {e["args"]["activity"] for e in mine}
    assert {"NEGOTIATE_ALLREDUCE", "QUEUE", "ALLREDUCE", "WAIT_FOR_DATA"} <= activities, activities

"""Async and grouped movement collectives, sparse_allreduce_async and runtime timeline control on
2 gloo processes, against closed-form per-rank values (one spawned run carries every check)."""

from __future__ import annotations

import json
import os

import torch

from tests.multiproc import run_workers


def _async_forms(hvd, r: int, n: int) -> dict:
    rows = torch.arange(float(r + 1)).reshape(-1, 1) + 10 * r  # rank r sends r + 1 rows
    h_gather = hvd.allgather_async(rows, name="ag")
    bcast_src = torch.full((2, 2), float(r + 5))
    h_bcast = hvd.broadcast_async(bcast_src, root_rank=1, name="bc")
    inplace = torch.full((3,), float(r))
    h_bcast_ = hvd.broadcast_async_(inplace, root_rank=0, name="bc_")
    h_a2a = hvd.alltoall_async(torch.arange(4.0) + 100 * r, name="a2a")
    h_a2a_s = hvd.alltoall_async(torch.arange(3.0) + 100 * r, splits=[1, 2], name="a2as")
    h_rs = hvd.reducescatter_async(torch.arange(5.0) * (r + 1), op=hvd.Sum, name="rs")
    handles = [h_gather, h_bcast, h_bcast_, h_a2a, h_a2a_s, h_rs]
    polls = [isinstance(hvd.poll(h), bool) for h in handles]
    a2a_out, a2a_splits = hvd.synchronize(h_a2a)
    a2a_s_out, a2a_s_splits = hvd.synchronize(h_a2a_s)
    return {
        "polls_bool": all(polls),
        "allgather": hvd.synchronize(h_gather).flatten().tolist(),
        "broadcast": hvd.synchronize(h_bcast).flatten().tolist(),
        "broadcast_src_unchanged": bcast_src.flatten().tolist(),
        "broadcast_inplace_same": hvd.synchronize(h_bcast_) is inplace,
        "broadcast_inplace": inplace.tolist(),
        "alltoall": (a2a_out.tolist(), a2a_splits.tolist(), str(a2a_splits.dtype)),
        "alltoall_splits": (a2a_s_out.tolist(), a2a_s_splits.tolist()),
        "reducescatter": hvd.synchronize(h_rs).tolist(),
        "done_after": all(hvd.poll(h) for h in handles),
        "sync_again": hvd.synchronize(h_rs).tolist(),  # idempotent
    }


def _grouped_and_sparse(hvd, r: int, n: int) -> dict:
    gathered = hvd.grouped_allgather([torch.full((r + 1,), float(r)), torch.tensor([[r, -r]])])
    scattered = hvd.grouped_reducescatter(
        [torch.arange(4.0) * (r + 1), torch.arange(3, dtype=torch.int64) + r], op=hvd.Sum
    )
    avg_scattered = hvd.synchronize(hvd.grouped_reducescatter_async([torch.full((2, 2), float(r))]))
    sparse = torch.sparse_coo_tensor([[r, 2]], [1.0 + r, 10.0], (4,))
    h_sparse = hvd.sparse_allreduce_async(sparse, name="emb", op=hvd.Sum)
    h_sparse_avg = hvd.sparse_allreduce_async(sparse, name="emb_avg")
    return {
        "grouped_allgather": [g.tolist() for g in gathered],
        "grouped_reducescatter": [s.tolist() for s in scattered],
        "grouped_reducescatter_dtypes": [str(s.dtype) for s in scattered],
        "grouped_reducescatter_avg": [s.tolist() for s in avg_scattered],
        "sparse_sum": h_sparse().to_dense().tolist(),  # Horovod calls the handle
        "sparse_avg": hvd.synchronize(h_sparse_avg).to_dense().tolist(),
    }


def _timeline(hvd, r: int, path: str) -> dict:
    hvd.allreduce(torch.ones(1), name="before_start")
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(2), name="inside.allreduce")
    hvd.synchronize(hvd.allgather_async(torch.ones(1), name="inside.allgather"))
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(3), name="after_stop")
    hvd.stop_timeline()  # a second stop is a no-op
    return {"timeline_written_by_rank0_only": os.path.exists(path) if r == 0 else True}


def _run(path: str) -> dict:
    import hvd_trainer as hvd

    r, n = hvd.rank(), hvd.size()
    out = {**_async_forms(hvd, r, n), **_grouped_and_sparse(hvd, r, n), **_timeline(hvd, r, path)}
    out["is_homogeneous"] = hvd.is_homogeneous()
    out["gloo_enabled"] = hvd.gloo_enabled()
    out["mpi_enabled"] = hvd.mpi_enabled()
    return out


def test_async_grouped_sparse_and_timeline(tmp_path) -> None:
    path = str(tmp_path / "tl" / "timeline.json")
    results = run_workers(_run, 2, args=(path,), timeout_seconds=120)
    for r, res in enumerate(results):
        assert res["polls_bool"] and res["done_after"]
        assert res["allgather"] == [0.0, 10.0, 11.0]
        assert res["broadcast"] == [6.0] * 4
        assert res["broadcast_src_unchanged"] == [float(r + 5)] * 4
        assert res["broadcast_inplace_same"] and res["broadcast_inplace"] == [0.0] * 3
        # alltoall of [0,1,2,3]+100r without splits: rank j gets rows [2j, 2j+1] of every rank
        mine = [2.0 * r, 2.0 * r + 1]
        assert res["alltoall"] == (mine + [100 + v for v in mine], [2, 2], "torch.int32")
        expect_s = ([0.0, 100.0], [1, 1]) if r == 0 else ([1.0, 2.0, 101.0, 102.0], [2, 2])
        assert res["alltoall_splits"] == expect_s
        # sum over ranks of arange(5)*(r+1) = arange(5)*3; 5 rows: rank 0 gets 3, rank 1 gets 2
        assert res["reducescatter"] == ([0.0, 3.0, 6.0] if r == 0 else [9.0, 12.0])
        assert res["sync_again"] == res["reducescatter"]
        assert res["grouped_allgather"] == [[0.0, 1.0, 1.0], [[0, 0], [1, -1]]]
        # [0,1,2,3]*(1+2) split 2/2; int64 arange(3)+r summed = [1,3,5] split 2/1
        assert res["grouped_reducescatter"] == ([[0.0, 3.0], [1, 3]] if r == 0 else [[6.0, 9.0], [5]])
        assert res["grouped_reducescatter_dtypes"] == ["torch.float32", "torch.int64"]
        assert res["grouped_reducescatter_avg"] == [[[0.5, 0.5]]]  # mean of 0 and 1, one row each
        assert res["sparse_sum"] == [1.0, 2.0, 20.0, 0.0]
        assert res["sparse_avg"] == [0.5, 1.0, 10.0, 0.0]
        assert res["is_homogeneous"] is True and res["gloo_enabled"] is True
        assert res["mpi_enabled"] is False
    assert results[0]["timeline_written_by_rank0_only"]
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    tensors = {e["args"]["tensor"] for e in doc["traceEvents"] if e.get("ph") == "X"}
    assert {"inside.allreduce", "inside.allgather"} <= tensors, tensors
    assert not tensors & {"before_start", "after_stop"}, tensors
    phases = {e["name"] for e in doc["traceEvents"] if e.get("ph") == "X"}
    assert {"allreduce", "allgather", "wait", "queue"} <= phases, phases

"""join() with uneven inputs on 2 gloo processes (Horovod semantics).

Rank 0 has 2 batches, rank 1 has 4. After rank 0 joins, rank 1's gradient averages still divide
by the full size (its gradient / 2), plain allreduces see zeros (identity for Min/Max) from
the joined rank, join() returns the last rank to join on both ranks, and the job keeps working
afterwards. Finally an allgather while a rank is joined raises JoinedRankError on both ranks.
"""

from __future__ import annotations

import time

import torch

from tests.multiproc import run_workers

BATCHES = {0: 2, 1: 4}


def _x(r: int, b: int) -> torch.Tensor:
    return torch.full((4,), float(10 * r + b + 1))


def _join_run() -> dict:
    import hvd_trainer as hvd
    from hvd_trainer.comm import GradientReducer

    r = hvd.rank()
    p = torch.nn.Parameter(torch.zeros(4))
    reducer = GradientReducer([("p", p)], world=hvd.get_world())
    grads = []
    for b in range(BATCHES[r]):
        p.grad = None
        (p * _x(r, b)).sum().backward()  # local gradient = _x(r, b)
        reducer.wait()
        grads.append(p.grad.tolist())
    out: dict = {"grads": grads}
    if r == 1:  # rank 0 has joined by now
        v = torch.tensor([5.0])
        out["avg"] = hvd.allreduce(v).tolist()
        out["sum"] = hvd.allreduce(v, op=hvd.Sum).tolist()
        out["min"] = hvd.allreduce(v, op=hvd.Min).tolist()
        out["max"] = hvd.allreduce(-v, op=hvd.Max).tolist()
        out["grouped"] = [t.tolist() for t in hvd.grouped_allreduce([v, 2 * v], op=hvd.Sum)]
    t0 = time.monotonic()
    out["last"] = hvd.join()
    out["join_seconds"] = time.monotonic() - t0
    out["after"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="after").tolist()
    # second round: rank 0 joins again, rank 1 tries an allgather -> error on both
    try:
        if r == 0:
            hvd.join()
        else:
            hvd.allgather(torch.ones(1), name="gathered_while_joined")
        out["join_error"] = "no error"
    except hvd.JoinedRankError as exc:
        out["join_error"] = str(exc)
    return out


def test_join_uneven_batches() -> None:
    results = run_workers(_join_run, 2, timeout_seconds=120)
    r0, r1 = results
    both = [((_x(0, i) + _x(1, i)) / 2).tolist() for i in range(2)]
    assert r0["grads"] == both
    assert r1["grads"] == both + [(_x(1, i) / 2).tolist() for i in (2, 3)]  # zeros from rank 0
    assert r1["avg"] == [2.5] and r1["sum"] == [5.0] and r1["min"] == [5.0] and r1["max"] == [-5.0]
    assert r1["grouped"] == [[5.0], [10.0]]
    assert r0["last"] == r1["last"] == 1
    assert r0["after"] == r1["after"] == [1.0]
    for res in results:
        assert "allgather 'gathered_while_joined'" in res["join_error"], res["join_error"]
        assert "join()" in res["join_error"] and "HINT" in res["join_error"]

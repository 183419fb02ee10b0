"""join() with uneven inputs on 2 gloo processes (Horovod semantics).

Rank 0 has 2 batches, rank 1 has 4. After rank 0 joins, rank 1's gradient averages still divide
by the full size (its gradient / 2), plain allreduces see zeros (identity for Min/Max) from
the joined rank, join() returns the last rank to join on both ranks, and the job keeps working
afterwards. Finally an allgather or a broadcast while a rank is joined raises JoinedRankError on
the calling rank only, and the joined rank's join() returns when the caller joins too.
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
    # second round: rank 0 joins again, rank 1 tries an allgather and a broadcast -> an error
    # on rank 1 only (as in Horovod); rank 0's join() returns once rank 1 joins too
    out["join_error"] = []
    if r == 0:
        out["second_last"] = hvd.join()
    else:
        for call in (lambda: hvd.allgather(torch.ones(1), name="gathered_while_joined"),
                     lambda: hvd.broadcast(torch.ones(1), 1, name="broadcast_while_joined")):
            try:
                call()
                out["join_error"].append("no error")
            except hvd.JoinedRankError as exc:
                out["join_error"].append(str(exc))
        out["second_last"] = hvd.join()
    # the join is over on both ranks: unrelated collectives work, also after shutdown/init
    out["gather_after"] = hvd.allgather(torch.tensor([r]), name="gather_after").tolist()
    hvd.shutdown()
    hvd.init()
    out["bcast_after_init"] = hvd.broadcast(torch.tensor([r]), 1, name="bcast_after").tolist()
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
    assert r0["join_error"] == []  # the joined rank does not raise
    gathered, broadcast = r1["join_error"]
    assert "allgather 'gathered_while_joined'" in gathered, gathered
    assert "broadcast 'broadcast_while_joined'" in broadcast, broadcast
    for text in (gathered, broadcast):
        assert "join()" in text and "HINT" in text
    assert r0["second_last"] == r1["second_last"] == 1
    for res in results:
        assert res["gather_after"] == [0, 1]
        assert res["bcast_after_init"] == [1]

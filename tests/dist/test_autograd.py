"""Backward through allreduce / allgather / broadcast, Horovod's semantics, on 2 and 3 ranks."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_workers


def _grads() -> dict:
    import hvd_trainer as hvd

    r, n = hvd.rank(), hvd.size()
    out = {}
    x = torch.full((3,), float(r + 1), requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).backward(torch.ones(3))
    out["sum"] = x.grad.tolist()
    x = torch.full((3,), float(r + 1), requires_grad=True)
    y = hvd.allreduce(x)  # Average
    y.backward(torch.full((3,), 2.0))
    out["avg"] = x.grad.tolist()
    out["avg_value"] = y.tolist()
    x = torch.full((r + 1, 2), float(r), requires_grad=True)
    g = hvd.allgather(x)
    total = g.shape[0]
    g.backward(torch.arange(total * 2, dtype=torch.float32).reshape(total, 2))
    out["gather"] = x.grad.tolist()
    x = torch.full((2,), float(r), requires_grad=True)
    b = hvd.broadcast(x, root_rank=n - 1)
    (b * 3).sum().backward()
    out["bcast"] = x.grad.tolist()
    out["bcast_value"] = b.tolist()
    x = torch.ones(2, requires_grad=True)
    try:
        hvd.allreduce(x, op=hvd.Max).sum().backward()
        out["max_error"] = None
    except RuntimeError as exc:
        out["max_error"] = str(exc)
    with torch.no_grad():
        out["no_grad_plain"] = hvd.allreduce(torch.ones(1, requires_grad=True)).requires_grad
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_collective_gradients(n: int) -> None:
    results = run_workers(_grads, n, timeout_seconds=120)
    mean = sum(range(1, n + 1)) / n
    total = n * (n + 1) // 2
    ys = torch.arange(total * 2, dtype=torch.float32).reshape(total, 2)
    for r, res in enumerate(results):
        assert res["sum"] == [float(n)] * 3  # d(sum_r x_r)/dx, summed over every rank's output
        assert res["avg"] == [2.0] * 3  # Average of the gradient 2.0
        assert res["avg_value"] == [mean] * 3
        start = r * (r + 1) // 2
        assert res["gather"] == ys[start : start + r + 1].tolist()  # this rank's rows
        assert res["bcast"] == ([3.0, 3.0] if r == n - 1 else [0.0, 0.0])
        assert res["bcast_value"] == [float(n - 1)] * 2
        assert res["max_error"] is not None and "no gradient" in res["max_error"]
        assert res["no_grad_plain"] is False

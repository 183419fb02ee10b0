"""Backward through alltoall, grouped_allreduce, grouped_allgather, reducescatter and
grouped_reducescatter (issue 11, class 2), on 2 and 3 gloo ranks and inside a process set.

Each gradient is compared with its closed form:

* alltoall: each rank gets back the upstream gradient of the rows it sent;
* grouped_allreduce: as allreduce, per tensor (Sum: the sum of the upstream gradients,
  Average: their average);
* grouped_allgather: the average of the upstream gradients, this rank's rows;
* reducescatter (Sum): the allgather of every member's block gradient, times the scale
  factors, divided by the set size for Average.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_workers


def send_splits(r: int, n: int) -> list[int]:
    """Rows rank ``r`` sends to member ``j``: ``r + j + 1``."""
    return [r + j + 1 for j in range(n)]


def weights(rows: int, cols: int, r: int) -> torch.Tensor:
    """Rank ``r``'s upstream gradient for an output of shape [rows, cols]."""
    return torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols) + 100 * r


def _grad_of(fn, x: torch.Tensor) -> list:
    x = x.clone().requires_grad_(True)
    fn(x)
    return x.grad.tolist()


def _scatter(hvd, x: torch.Tensor, r: int, pset, **kw) -> None:
    y = hvd.reducescatter(x, process_set=pset, **kw)
    (y * (r + 1)).sum().backward()


def _run(members: list[int] | None) -> dict:
    import hvd_trainer as hvd

    pset = hvd.add_process_set(members) if members else None
    if pset is not None and not pset.included():
        return {}
    r = pset.rank() if pset is not None else hvd.rank()
    n = pset.size() if pset is not None else hvd.size()
    out: dict = {}

    x = torch.ones(sum(send_splits(r, n)), 2, dtype=torch.float64, requires_grad=True)
    y, received = hvd.alltoall(x, torch.tensor(send_splits(r, n), dtype=torch.int32), process_set=pset)
    out["a2a_has_grad_fn"] = y.grad_fn is not None
    (y * weights(y.shape[0], 2, r)).sum().backward()
    out["a2a"], out["received"] = x.grad.tolist(), received.tolist()
    x = torch.ones(2 * n, 1, dtype=torch.float64, requires_grad=True)
    y = hvd.alltoall(x, process_set=pset)  # equal splits, no splits returned
    (y * weights(2 * n, 1, r)).sum().backward()
    out["a2a_equal"] = x.grad.tolist()

    for op in ("Sum", "Average"):
        a = torch.full((3,), float(r + 1), requires_grad=True)
        b = torch.full((2, 2), float(r), requires_grad=True)
        ya, yb = hvd.grouped_allreduce([a, b], op=getattr(hvd, op), process_set=pset)
        (ya * (r + 2)).sum().add((yb * 3).sum()).backward()
        out[f"grouped_{op}"] = (a.grad.tolist(), b.grad.tolist(), ya.tolist())

    a = torch.zeros(r + 1, 2, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    ga, gb = hvd.grouped_allgather([a, b], process_set=pset)
    (ga * weights(ga.shape[0], 2, r)).sum().add((gb * weights(n, 3, r)).sum()).backward()
    out["grouped_gather"] = (a.grad.tolist(), b.grad.tolist())

    rows = 2 * n + 1  # uneven blocks
    base = torch.ones(rows, 2, dtype=torch.float64)
    out["rs_sum"] = _grad_of(lambda t: _scatter(hvd, t, r, pset, op=hvd.Sum), base)
    out["rs_avg"] = _grad_of(lambda t: _scatter(hvd, t, r, pset), base)
    out["rs_scaled"] = _grad_of(
        lambda t: _scatter(hvd, t, r, pset, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5 * 3), base)
    p = torch.ones(rows, 2, dtype=torch.float64, requires_grad=True)
    q = torch.ones(n, dtype=torch.float64, requires_grad=True)
    yp, yq = hvd.grouped_reducescatter([p, q], op=hvd.Sum, process_set=pset)
    (yp * (r + 1)).sum().add((yq * 10 * (r + 1)).sum()).backward()
    out["grouped_rs"] = (p.grad.tolist(), q.grad.tolist())
    return out


def _block_rows(rows: int, n: int) -> list[int]:
    base, extra = divmod(rows, n)
    return [base + (1 if j < extra else 0) for j in range(n)]


def _check(res: dict, r: int, n: int) -> None:
    assert res["a2a_has_grad_fn"]
    assert res["received"] == [q + r + 1 for q in range(n)]  # rows from member q
    expect = []
    for j in range(n):  # the rows I sent to j sit in j's output after those of members < r
        offset = sum(q + j + 1 for q in range(r))
        expect.append(weights(sum(q + j + 1 for q in range(n)), 2, j)[offset : offset + r + j + 1])
    assert res["a2a"] == torch.cat(expect).tolist()
    assert res["a2a_equal"] == torch.cat([weights(2 * n, 1, j)[2 * r : 2 * r + 2] for j in range(n)]).tolist()

    up = sum(q + 2 for q in range(n))  # sum over ranks of the upstream factor (q + 2)
    a_sum, b_sum, ya_sum = res["grouped_Sum"]
    assert a_sum == [float(up)] * 3 and b_sum == [[3.0 * n] * 2] * 2
    assert ya_sum == [float(n * (n + 1) // 2)] * 3
    a_avg, b_avg, _ = res["grouped_Average"]
    assert a_avg == [up / n] * 3 and b_avg == [[3.0] * 2] * 2

    mean_shift = 100 * (n - 1) / 2  # the average of the ranks' upstream offsets 100 * q
    start = r * (r + 1) // 2
    total = n * (n + 1) // 2
    ga, gb = res["grouped_gather"]
    assert ga == (weights(total, 2, 0)[start : start + r + 1] + mean_shift).tolist()
    assert gb == (weights(n, 3, 0)[r : r + 1] + mean_shift).tolist()

    rows = 2 * n + 1
    per_row = torch.cat([torch.full((k, 2), float(j + 1), dtype=torch.float64)
                         for j, k in enumerate(_block_rows(rows, n))])  # block j's gradient: j + 1
    assert res["rs_sum"] == per_row.tolist()
    assert res["rs_avg"] == (per_row / n).tolist()
    assert res["rs_scaled"] == (per_row * 3).tolist()
    p_grad, q_grad = res["grouped_rs"]
    assert p_grad == per_row.tolist()
    assert q_grad == [10.0 * (j + 1) for j in range(n)]  # one row per member


@pytest.mark.parametrize("n", [2, 3])
def test_variant_gradients_match_the_closed_form(n: int) -> None:
    results = run_workers(_run, n, args=(None,), timeout_seconds=180)
    for r, res in enumerate(results):
        _check(res, r, n)


def test_variant_gradients_inside_a_process_set() -> None:
    results = run_workers(_run, 3, args=([0, 2],), timeout_seconds=180)
    assert results[1] == {}
    _check(results[0], 0, 2)
    _check(results[2], 1, 2)


def _horovod_scale() -> dict:
    """Horovod's ``test_horovod_reducescatter_grad`` and ``..._grad_average`` (test_torch.py):
    a [4 * size]^dim tensor, the output's gradient all ones; under
    ``HVD_TRAINER_REDUCESCATTER_GRAD=horovod`` the input's gradient is size (Sum) and 1
    (Average), and the variable is read at each backward (so unset gives the adjoint again)."""
    import os

    import hvd_trainer as hvd

    size, out = hvd.size(), {}
    for dim in (1, 2, 3):
        for op in ("Sum", "Average"):
            x = torch.empty(*([size * 4] * dim), dtype=torch.float64).uniform_(-100, 100).requires_grad_()
            y = hvd.reducescatter(x, op=getattr(hvd, op))
            y.backward(torch.ones([4] + [size * 4] * (dim - 1), dtype=torch.float64))
            out[(op, dim)] = sorted(set(x.grad.flatten().tolist()))
    os.environ["HVD_TRAINER_REDUCESCATTER_GRAD"] = "adjoint"
    x = torch.ones(size * 4, dtype=torch.float64, requires_grad=True)
    hvd.reducescatter(x, op=hvd.Sum).sum().backward()
    out["adjoint"] = sorted(set(x.grad.tolist()))
    os.environ["HVD_TRAINER_REDUCESCATTER_GRAD"] = "hovorod"  # a typo is refused, not ignored
    x = torch.ones(size * 4, dtype=torch.float64, requires_grad=True)
    try:
        hvd.reducescatter(x, op=hvd.Sum).sum().backward()
        out["typo"] = "accepted"
    except ValueError as exc:
        out["typo"] = str(exc)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_horovod_reducescatter_gradient_scale_on_request(n: int) -> None:
    results = run_workers(_horovod_scale, n, env={"HVD_TRAINER_REDUCESCATTER_GRAD": "horovod"},
                          timeout_seconds=180)
    for res in results:
        for dim in (1, 2, 3):
            assert res[("Sum", dim)] == [float(n)] and res[("Average", dim)] == [1.0], res
        assert res["adjoint"] == [1.0]
        assert "HVD_TRAINER_REDUCESCATTER_GRAD='hovorod'" in res["typo"] and "'horovod'" in res["typo"]

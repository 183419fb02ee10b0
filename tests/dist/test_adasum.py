"""Adasum over 2, 3 and 4 gloo ranks: closed-form values, per-tensor coefficients, equality
across ranks, Horovod's optimizer semantics, and training the digits data."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_workers


def _ref_pair(a: list[float], b: list[float]) -> list[float]:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na, nb = sum(x * x for x in a), sum(y * y for y in b)
    ca = 1.0 - dot / (2 * na) if na else 1.0
    cb = 1.0 - dot / (2 * nb) if nb else 1.0
    return [ca * x + cb * y for x, y in zip(a, b, strict=True)]


def _ref_tree(vs: list[list[float]]) -> list[float]:
    while len(vs) > 1:
        nxt = [_ref_pair(vs[i], vs[i + 1]) for i in range(0, len(vs) - 1, 2)]
        vs = nxt + ([vs[-1]] if len(vs) % 2 else [])
    return vs[0]


def _vec(r: int) -> list[float]:
    return [1.0 + r, 0.5 - r, 0.25 * r * r, -1.0]


def _collectives() -> dict:
    import hvd_trainer as hvd
    from hvd_trainer.comm.base.errors import CommTypeError

    r, n = hvd.rank(), hvd.size()
    out: dict = {}
    out["general"] = hvd.allreduce(torch.tensor(_vec(r), dtype=torch.float64), op=hvd.Adasum).tolist()
    out["f32"] = hvd.allreduce(torch.tensor(_vec(r)), op=hvd.Adasum).tolist()
    out["same"] = hvd.allreduce(torch.tensor([3.0, -1.0, 2.0]), op=hvd.Adasum).tolist()
    out["orth"] = hvd.allreduce(torch.eye(n)[r] * (r + 1), op="adasum").tolist()
    t = torch.tensor(_vec(r), dtype=torch.float64)
    h = hvd.allreduce_async_(t, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.5)
    out["inplace_scaled"] = hvd.synchronize(h).tolist()
    # grouped: tensor a identical on every rank (averaged), b orthogonal (summed), c general
    a, b = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.eye(n)[r] * (r + 1)
    c = torch.tensor(_vec(r), dtype=torch.float64)
    res = hvd.grouped_allreduce([a, b, c], op=hvd.Adasum)
    out["grouped"] = [x.tolist() for x in res]
    try:
        hvd.allreduce(torch.ones(2, dtype=torch.int64), op=hvd.Adasum)
        out["int_error"] = None
    except CommTypeError as exc:
        out["int_error"] = str(exc)
    out["after_error"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).item()  # still in step
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_adasum_collectives_closed_form(n: int) -> None:
    results = run_workers(_collectives, n, timeout_seconds=200)
    vecs = [_vec(r) for r in range(n)]
    general = _ref_tree(vecs)
    for res in results:
        assert res["general"] == pytest.approx(general, rel=1e-12)
        assert res["f32"] == pytest.approx(general, rel=1e-5)
        assert res["same"] == [3.0, -1.0, 2.0]
        assert res["orth"] == [float(i + 1) for i in range(n)]
        # prescale 2, postscale 0.5: Adasum is homogeneous (adasum(2a, 2b) = 2 adasum(a, b))
        assert res["inplace_scaled"] == pytest.approx(general, rel=1e-12)
        a, b, c = res["grouped"]
        assert a == [[1.0, 2.0], [3.0, 4.0]]
        assert b == [float(i + 1) for i in range(n)]
        assert c == pytest.approx(general, rel=1e-12)
        assert "Adasum needs a floating tensor" in res["int_error"]
        assert res["after_error"] == n * (n - 1) / 2
    # every rank evaluates the same tree on the same data: bitwise equal
    assert all(res["general"] == results[0]["general"] for res in results)
    assert all(res["f32"] == results[0]["f32"] for res in results)


def _optimizer_step() -> dict:
    import hvd_trainer as hvd

    r = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    torch.manual_seed(100 + r)  # different data on every rank
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    torch.nn.functional.mse_loss(model(x), y).backward()
    local_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    grads_after_step = {n: p.grad.tolist() for n, p in model.named_parameters()}
    # a second, Adam-wrapped run: state stays local, weights still agree
    torch.manual_seed(0)
    model2 = torch.nn.Linear(3, 2)
    opt2 = hvd.DistributedOptimizer(torch.optim.Adam(model2.parameters(), lr=0.01), op=hvd.Adasum)
    for step in range(3):
        opt2.zero_grad()
        torch.manual_seed(1000 * step + r)
        torch.nn.functional.mse_loss(model2(torch.randn(4, 3)), torch.randn(4, 2)).backward()
        opt2.step()
    return {
        "start": {k: v.tolist() for k, v in start.items()},
        "local_grads": {k: v.tolist() for k, v in local_grads.items()},
        "grads_after_step": grads_after_step,
        "weights": {k: v.tolist() for k, v in model.state_dict().items()},
        "adam_weights": [p.tolist() for p in model2.parameters()],
        "op": str(opt.op),
    }


def _flat(x) -> list[float]:
    return torch.tensor(x, dtype=torch.float64).reshape(-1).tolist()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 3])
def test_optimizer_combines_weight_deltas(n: int) -> None:
    results = run_workers(_optimizer_step, n, timeout_seconds=200)
    for name in ("weight", "bias"):
        # Horovod's semantics: each rank steps on its own gradient (delta = -lr * g_r), the deltas
        # are combined per parameter with Adasum, and every rank applies the combination
        deltas = [[-0.1 * g for g in _flat(res["local_grads"][name])] for res in results]
        expected = [w + d for w, d in zip(_flat(results[0]["start"][name]), _ref_tree(deltas), strict=True)]
        for res in results:
            assert _flat(res["weights"][name]) == pytest.approx(expected, rel=1e-5, abs=1e-7)
            assert res["grads_after_step"][name] == res["local_grads"][name]  # gradients stay local
    assert all(res["adam_weights"] == results[0]["adam_weights"] for res in results)
    assert all(res["weights"] == results[0]["weights"] for res in results)


def _train_digits(op_name: str) -> float:
    from sklearn.datasets import load_digits

    import hvd_trainer as hvd

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=gen)
    train, val = perm[:1500], perm[1500:]
    shard = train[hvd.rank()::hvd.size()]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    op = hvd.Adasum if op_name == "adasum" else hvd.Average
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=op)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for epoch in range(15):
        order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch))]
        for i in range(0, len(order), 32):
            idx = order[i : i + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    with torch.no_grad():
        acc = (model(x[val]).argmax(1) == y[val]).float().mean()
    return float(hvd.allreduce(acc, op=hvd.Max).item()), [p.sum().item() for p in model.parameters()]


@pytest.mark.timeout(300)
def test_adasum_trains_digits_like_average() -> None:
    adasum = run_workers(_train_digits, 2, args=("adasum",), timeout_seconds=240)
    average = run_workers(_train_digits, 2, args=("average",), timeout_seconds=240)
    acc_adasum, acc_average = adasum[0][0], average[0][0]
    print(f"digits val_acc adasum={acc_adasum:.3f} average={acc_average:.3f}")
    assert adasum[0][1] == adasum[1][1]  # weights equal across ranks
    assert acc_average > 0.9
    assert acc_adasum > 0.9 and abs(acc_adasum - acc_average) < 0.04

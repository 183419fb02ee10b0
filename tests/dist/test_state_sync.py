"""broadcast_parameters / broadcast_optimizer_state on 2 processes: every rank ends with the
root's values and hyperparameters (types kept), and the next step is the one the root's
optimizer would have taken without the broadcast."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests.multiproc import run_workers


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model[0].bias.requires_grad_(False)  # frozen, but still in the optimizer
    return model


# Rank-dependent hyperparameters; rank 0 (the root) also changes the state's structure.
OPTS = {
    "sgd": lambda p, r: torch.optim.SGD(p, lr=0.1 * (r + 1)),
    "momentum": lambda p, r: torch.optim.SGD(p, lr=0.1, momentum=0.9 - 0.4 * r, nesterov=r == 0),
    "adam": lambda p, r: torch.optim.Adam(p, lr=0.01, betas=(0.8 - 0.3 * r, 0.9 - 0.3 * r)),
    "adamw": lambda p, r: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1 + r, amsgrad=r == 0),
    "rmsprop": lambda p, r: torch.optim.RMSprop(p, lr=0.01, alpha=0.9 - 0.4 * r, centered=r == 0),
    "adagrad": lambda p, r: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01 * r,
                                                initial_accumulator_value=0.1 * r),
}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _groups(opt: torch.optim.Optimizer) -> list[dict]:
    return [
        {k: (type(v).__name__, repr(v)) for k, v in g.items() if k != "params"}
        for g in opt.param_groups
    ]


def _state(opt: torch.optim.Optimizer) -> dict:
    return {
        str(i): {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
        for i, s in opt.state_dict()["state"].items()
    }


def _optimizer_case(kind: str, rank: int) -> dict:
    import hvd_trainer as hvd

    model = _model()
    opt = OPTS[kind](model.parameters(), rank)
    steps = 2 if rank == 0 else int(kind in ("adam", "rmsprop"))  # rank 1: no or other state
    for s in range(steps):
        _step(model, opt, seed=10 * rank + s)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref_model, ref_opt = copy.deepcopy((model, opt))  # the root without the broadcast
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out = {"groups": _groups(opt), "state": _state(opt)}
    _step(model, opt, seed=99)
    _step(ref_model, ref_opt, seed=99)
    out["w"] = _flat(model)
    out["root_unchanged"] = _flat(model) == _flat(ref_model) and _state(opt) == _state(ref_opt)
    out["state_after"] = _state(opt)
    return out


def _worker() -> dict:
    import hvd_trainer as hvd

    rank, res = hvd.rank(), {}
    torch.manual_seed(rank)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    net[1].num_batches_tracked.fill_(rank + 5)
    net[1].running_var.fill_(rank + 2.0)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    res["state_dict"] = {k: v.tolist() for k, v in net.state_dict().items()}
    torch.manual_seed(rank)
    lin = torch.nn.Linear(2, 2)
    hvd.broadcast_parameters(lin.named_parameters(), root_rank=1)
    torch.manual_seed(1)
    res["named_from_rank1"] = lin.weight.tolist() == torch.nn.Linear(2, 2).weight.tolist()
    for kind in OPTS:
        res[kind] = _optimizer_case(kind, rank)

    # Through DistributedOptimizer: rank 1's changed lr and buffers are overwritten.
    model = _model()
    dopt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                    model.named_parameters())
    _step(model, dopt, seed=5)
    if rank == 1:
        dopt.param_groups[0]["lr"] = 1.0
        for s in dopt.state.values():
            s["exp_avg"].mul_(3.0)
    hvd.broadcast_optimizer_state(dopt, root_rank=0)
    res["dopt"] = {"groups": _groups(dopt), "state": _state(dopt)}

    with pytest.raises(ValueError, match="root_rank=5"):
        hvd.broadcast_parameters(net.state_dict(), root_rank=5)
    with pytest.raises(TypeError, match="HINT"):
        hvd.broadcast_parameters([1, 2], root_rank=0)
    return res


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 2, timeout_seconds=120)


def test_broadcast_parameters(results: list[dict]) -> None:
    r0, r1 = results
    assert r0["state_dict"] == r1["state_dict"]
    assert r1["state_dict"]["1.num_batches_tracked"] == 5
    assert r1["state_dict"]["1.running_var"] == [2.0] * 4
    assert r0["named_from_rank1"] and r1["named_from_rank1"]


@pytest.mark.parametrize("kind", list(OPTS))
def test_broadcast_optimizer_state(results: list[dict], kind: str) -> None:
    r0, r1 = results[0][kind], results[1][kind]
    assert r0["groups"] == r1["groups"]  # values and Python types (tuple betas, bool flags)
    assert r0["state"] == r1["state"]
    assert r0["root_unchanged"]
    assert r0["w"] == r1["w"]  # the next step is identical on every rank
    assert r0["state_after"] == r1["state_after"]


def test_types_and_structure_kept(results: list[dict]) -> None:
    assert results[1]["adam"]["groups"][0]["betas"] == ("tuple", "(0.8, 0.9)")
    assert results[1]["adamw"]["groups"][0]["amsgrad"] == ("bool", "True")
    assert all("max_exp_avg_sq" in s for s in results[1]["adamw"]["state"].values())
    assert results[1]["sgd"]["state"] == {}  # stateless: only hyperparameters travel
    assert results[1]["sgd"]["groups"][0]["lr"] == ("float", "0.1")


def test_broadcast_through_distributed_optimizer(results: list[dict]) -> None:
    assert results[0]["dopt"] == results[1]["dopt"]
    assert results[1]["dopt"]["groups"][0]["lr"] == ("float", "0.01")


def _fresh_and_drift_worker() -> dict:
    """A fresh optimizer stays fresh (training equals a run without the broadcast), and models
    that differ between ranks are refused on every rank, naming the tensor, before any copy."""
    import hvd_trainer as hvd

    rank, res = hvd.rank(), {}
    for kind, make in (("adam", lambda p: torch.optim.Adam(p, lr=0.01)),
                       ("sgd_wd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1))):
        runs = []
        for broadcast in (True, False):
            model = _model()
            opt = make(model.parameters())
            if broadcast:
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
                hvd.broadcast_optimizer_state(opt, root_rank=0)
                res[f"{kind}-state_after_broadcast"] = len(opt.state)
                res[f"{kind}-grads_zero"] = [None if p.grad is None else float(p.grad.abs().sum())
                                             for p in model.parameters()]
            for s in range(3):
                _step(model, opt, seed=s)
            runs.append(_flat(model))
        res[f"{kind}-equal_to_unbroadcast"] = runs[0] == runs[1]

    # Same element count, other shapes: the flat buffer would fit, the layout does not.
    torch.manual_seed(rank)
    lin = torch.nn.Linear(2, 6) if rank == 0 else torch.nn.Linear(3, 4)
    before = lin.weight.detach().clone()
    for form in ("state_dict", "named_parameters"):
        params = lin.state_dict() if form == "state_dict" else lin.named_parameters()
        try:
            hvd.broadcast_parameters(params, root_rank=0)
            res[f"same_numel-{form}"] = None
        except ValueError as exc:
            res[f"same_numel-{form}"] = str(exc)
    res["same_numel-untouched"] = torch.equal(lin.weight, before)
    # An extra layer on one rank; then the optimizers of models that differ.
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), *([torch.nn.Linear(4, 4)] if rank == 1 else []))
    try:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        res["extra_layer"] = None
    except ValueError as exc:
        res["extra_layer"] = str(exc)
    model = torch.nn.Linear(3, 5 if rank == 0 else 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _step_any(model, opt)
    dopt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    for name, o in (("opt_state", opt), ("dopt_state", dopt)):
        try:
            hvd.broadcast_optimizer_state(o, root_rank=0)
            res[name] = None
        except ValueError as exc:
            res[name] = str(exc)
    res["after"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).tolist()  # still in step

    res.update(_by_name_and_local_errors(hvd, rank))
    return res


def _by_name_and_local_errors(hvd: Any, rank: int) -> dict:
    res: dict = {}
    # (name, tensor) lists are matched by name, as in Horovod: another order on one rank works
    torch.manual_seed(rank)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    pairs = list(net.named_parameters())
    hvd.broadcast_parameters(pairs if rank == 0 else pairs[::-1], root_rank=0)
    torch.manual_seed(0)
    root_net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    res["reordered_equal_root"] = all(
        torch.equal(a, b) for a, b in zip(net.parameters(), root_net.parameters(), strict=True))
    # DistributedOptimizer with names on one rank only: the same parameters, so it works
    model = torch.nn.Linear(3, 2)
    dopt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                    model.named_parameters() if rank == 0 else None)
    hvd.broadcast_optimizer_state(dopt, root_rank=0)
    res["named_on_root_only"] = "ok"
    # a local argument error on one rank: it raises its TypeError, the root a ValueError naming it
    sd = dict(net.state_dict())
    if rank == 1:
        sd["zzz"] = 3
    try:
        hvd.broadcast_parameters(sd, root_rank=0)
        res["local_error"] = None
    except (TypeError, ValueError) as exc:
        res["local_error"] = (type(exc).__name__, str(exc))
    # SparseAdam: the zero gradients Horovod gives a fresh optimizer are sparse, so it trains
    emb = torch.nn.Embedding(6, 2, sparse=True)
    sopt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(sopt, root_rank=0, model=emb)
    res["sparse_zero_grad"] = emb.weight.grad.is_sparse
    for _ in range(2):
        emb(torch.tensor([1, 4])).sum().backward()
        sopt.step()
        sopt.zero_grad()
    res["sparse_trained"] = len(sopt.state)
    res["after2"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).tolist()
    return res


def _step_any(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(2, model.in_features)).sum().backward()
    opt.step()


def test_fresh_optimizer_stays_fresh_and_model_drift_is_refused_on_every_rank() -> None:
    results = run_workers(_fresh_and_drift_worker, 2, timeout_seconds=120)
    for rank, res in enumerate(results):
        for kind in ("adam", "sgd_wd"):
            assert res[f"{kind}-state_after_broadcast"] == 0, kind
            # Horovod's visible side effect: trainable parameters get zero grads, frozen keep None
            assert res[f"{kind}-grads_zero"] == [0.0, None, 0.0, 0.0], kind
            assert res[f"{kind}-equal_to_unbroadcast"], kind
        want = "rank 1: tensor #0 is 'bias' [4] torch.float32 here, 'bias' [6] torch.float32 on"
        for form in ("state_dict", "named_parameters"):  # both travel in sorted name order
            msg = res[f"same_numel-{form}"]
            assert msg is not None, form
            assert want in msg, msg
            assert "Nothing was changed" in msg and "HINT" in msg
        if rank == 1:
            assert res["same_numel-untouched"]
        assert "rank 1: 4 tensors here, 2 on rank 0" in res["extra_layer"]
        assert "rank 1: tensor #0 is 'param_groups[0][0]' [4, 3]" in res["opt_state"]
        assert "rank 1: tensor #0 is 'weight' [4, 3] torch.float32 here, 'weight' [5, 3]" in res["dopt_state"]
        assert res["after"] == [2.0]
        assert res["reordered_equal_root"]
        assert res["named_on_root_only"] == "ok"
        kind, msg = res["local_error"]
        if rank == 1:
            assert kind == "TypeError" and "got a int entry" in msg, msg
        else:
            assert kind == "ValueError", msg
            assert "rank 1: TypeError: broadcast_parameters got a int entry" in msg, msg
        assert res["sparse_zero_grad"] and res["sparse_trained"] == 1
        assert res["after2"] == [2.0]

"""Small Horovod API facts on 2 gloo ranks (issue 11, classes 3 and 9):
``DistributedOptimizer(groups=..., num_groups=...)`` reduces each group as one grouped
allreduce and still averages every gradient; ``broadcast_optimizer_state`` leaves a fresh
optimizer fresh (no zero-gradient step: no Adam ``step`` of 1, horovod/horovod#2805), parameters
unmoved, ``.grad`` zeros as in Horovod;
``ProcessSet.ranks`` is a list; ``join(device)`` takes Horovod's device argument."""

from __future__ import annotations

import warnings

import torch

from tests.multiproc import run_workers


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2),
                               torch.nn.Linear(2, 1))


def _batch(r: int) -> torch.Tensor:
    return torch.arange(6.0).reshape(2, 3) * (r + 1) - 1.0


def _local_grads(r: int) -> list[torch.Tensor]:
    m = _model()
    m(_batch(r)).pow(2).sum().backward()
    return [p.grad.clone() for p in m.parameters()]


def _step(hvd, kwargs) -> tuple[list, list]:
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0),
                                   named_parameters=m.named_parameters(), **kwargs(m))
    m(_batch(hvd.rank())).pow(2).sum().backward()
    opt.step()
    reducers = getattr(opt._reducer, "reducers", [opt._reducer])
    layout = [len(r.bucket_sizes_bytes) for r in reducers]
    return [p.grad.tolist() for p in m.parameters()], layout


def _run() -> dict:
    import hvd_trainer.torch as hvd

    out: dict = {}
    out["groups_lists"] = _step(hvd, kwargs=lambda m: {"groups": [[m[0].weight, m[0].bias], [m[3].weight]]})
    out["groups_int"] = _step(hvd, kwargs=lambda m: {"groups": 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["num_groups"] = _step(hvd, kwargs=lambda m: {"num_groups": 2})
    out["num_groups_warned"] = any("num_groups" in str(w.message) for w in caught)
    out["plain"] = _step(hvd, kwargs=lambda m: {})
    try:
        _step(hvd, kwargs=lambda m: {"groups": [[m[0].weight], [m[0].weight]]})
        out["twice"] = None
    except ValueError as exc:
        out["twice"] = str(exc)

    m = torch.nn.Linear(2, 2)
    with torch.no_grad():
        m.weight.fill_(float(hvd.rank() + 1))
        m.bias.fill_(-1.0)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5)
    hvd.broadcast_parameters(m.state_dict(), root_rank=1)
    hvd.broadcast_optimizer_state(opt, root_rank=1)
    out["adam_state"] = sorted((float(s["step"]), s["exp_avg"].abs().sum().item(),
                                tuple(s["exp_avg_sq"].shape)) for s in opt.state.values())
    out["params_after"] = [m.weight.tolist(), m.bias.tolist()]
    out["grads_after"] = [p.grad.abs().sum().item() for p in m.parameters()]  # Horovod: zeros
    wrapped = hvd.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.1),
                                       named_parameters=m.named_parameters())
    hvd.broadcast_optimizer_state(wrapped, 0)  # no step, so no allreduce is started
    out["wrapped_state"] = len(wrapped.state)
    out["after"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).tolist()

    out["ranks"] = (hvd.global_process_set.ranks == [0, 1], type(hvd.global_process_set.ranks).__name__)
    pair = hvd.add_process_set([1])
    out["pair_ranks"] = pair.ranks
    out["join"] = hvd.join(-1)
    return out


def test_groups_optimizer_state_and_process_set_ranks() -> None:
    results = run_workers(_run, 2, timeout_seconds=180)
    g0, g1 = _local_grads(0), _local_grads(1)
    mean = [((a + b) / 2).tolist() for a, b in zip(g0, g1, strict=True)]
    for res in results:
        for key in ("groups_lists", "groups_int", "num_groups", "plain"):
            grads, _ = res[key]
            for got, want in zip(grads, mean, strict=True):
                assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-6), key
        # 2 groups (one bucket each) + the parameters in no group (3 tensors, bucketed as usual)
        assert res["groups_lists"][1][:2] == [1, 1] and len(res["groups_lists"][1]) == 3
        assert res["groups_int"][1] == [1, 1] and res["num_groups"][1] == [1, 1]
        assert len(res["plain"][1]) == 1
        assert res["num_groups_warned"]
        assert res["twice"] is not None and "two groups" in res["twice"] and "HINT" in res["twice"]
        assert res["adam_state"] == []  # the root's optimizer is fresh: so is every rank's
        assert res["params_after"] == [[[2.0, 2.0], [2.0, 2.0]], [-1.0, -1.0]]  # rank 1's, unmoved
        assert res["grads_after"] == [0.0, 0.0]
        assert res["wrapped_state"] == 0
        assert res["after"] == [2.0]
        assert res["ranks"] == (True, "list")
        assert res["pair_ranks"] == [1]
        assert res["join"] in (0, 1)

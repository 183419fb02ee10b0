"""The fused gradient reducer: averaged gradients equal the closed form, on every rank."""

from __future__ import annotations

import torch

from tests.multiproc import run_workers


def _reduce_linear_grads(threshold: int) -> dict:
    import hvd_trainer as hvd
    from hvd_trainer.comm import FusionConfig, GradientReducer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    unused = torch.nn.Linear(2, 2)  # never used on rank 1: must not hang, gets rank 0's grad/2
    params = list(model.named_parameters()) + [("unused." + n, p) for n, p in unused.named_parameters()]
    cfg = FusionConfig(fusion_threshold_bytes=threshold, first_bucket_bytes=threshold)
    reducer = GradientReducer(params, world=hvd.get_world(), config=cfg)
    x = torch.arange(8.0).reshape(2, 4) * (hvd.rank() + 1)
    loss = model(x).sum()
    if hvd.rank() == 0:
        loss = loss + unused(torch.ones(1, 2)).sum()
    loss.backward()
    reducer.wait()
    grads = {n: p.grad.clone() for n, p in params}
    # reference: average of per-rank local gradients, computed locally for both ranks
    ref = {}
    for r in range(hvd.size()):
        m2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        m2.load_state_dict(model.state_dict())
        u2 = torch.nn.Linear(2, 2)
        u2.load_state_dict(unused.state_dict())
        l2 = m2(torch.arange(8.0).reshape(2, 4) * (r + 1)).sum()
        if r == 0:
            l2 = l2 + u2(torch.ones(1, 2)).sum()
        l2.backward()
        for n, p in list(m2.named_parameters()) + [("unused." + n, p) for n, p in u2.named_parameters()]:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            ref[n] = ref.get(n, 0) + g / hvd.size()
    return {
        "max_err": max(float((grads[n] - ref[n]).abs().max()) for n in grads),
        "n_buckets": len(reducer.bucket_sizes_bytes),
        "grads": {n: g.tolist() for n, g in grads.items()},
    }


def test_fused_average_matches_reference() -> None:
    for threshold in (0, 1 << 20):
        results = run_workers(_reduce_linear_grads, 2, args=(threshold,))
        assert results[0]["grads"] == results[1]["grads"]
        for res in results:
            assert res["max_err"] <= 1e-6
        assert results[0]["n_buckets"] == (6 if threshold == 0 else 1)

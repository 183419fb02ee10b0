"""The fused gradient reducer on 2 gloo processes: closed-form gradients on every rank, bucket
layout, accumulation, scale factors, compression, process sets, frozen parameters, and a
bucket-layout mismatch that must raise (not hang). One spawned run carries every check."""

from __future__ import annotations

import time

import torch

from tests.multiproc import run_workers


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _local_grads(model, unused, r: int) -> dict:
    """Gradients rank ``r`` computes locally (unused layer only used on rank 0)."""
    m2, u2 = _model(), torch.nn.Linear(2, 2)
    m2.load_state_dict(model.state_dict())
    u2.load_state_dict(unused.state_dict())
    loss = m2(torch.arange(8.0).reshape(2, 4) * (r + 1)).sum()
    if r == 0:
        loss = loss + u2(torch.ones(1, 2)).sum()
    loss.backward()
    named = list(m2.named_parameters()) + [("unused." + n, p) for n, p in u2.named_parameters()]
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in named}


def _step(hvd, model, unused, reducer) -> None:
    loss = model(torch.arange(8.0).reshape(2, 4) * (hvd.rank() + 1)).sum()
    if hvd.rank() == 0:
        loss = loss + unused(torch.ones(1, 2)).sum()
    loss.backward()
    reducer.wait()


def _reference_case(hvd, threshold: int, scale: float, **kwargs) -> dict:
    from hvd_trainer.comm import FusionConfig, GradientReducer

    model, unused = _model(), torch.nn.Linear(2, 2)
    params = list(model.named_parameters()) + [("unused." + n, p) for n, p in unused.named_parameters()]
    never = torch.nn.Linear(3, 3)  # used on no rank: its grads must stay None, as in one process
    all_params = params[:2] + [("never." + n, p) for n, p in never.named_parameters()] + params[2:]
    cfg = FusionConfig(fusion_threshold_bytes=threshold, first_bucket_bytes=threshold)
    reducer = GradientReducer(all_params, world=hvd.get_world(), config=cfg, **kwargs)
    out = {"n_buckets": len(reducer.bucket_sizes_bytes)}
    for step in range(2):  # step 2 after zero_grad(set_to_none=True): same result again
        model.zero_grad(set_to_none=True)
        unused.zero_grad(set_to_none=True)
        _step(hvd, model, unused, reducer)
        out[f"grads{step}"] = {n: p.grad.clone() for n, p in params}
        out["views"] = all(_in_bucket(reducer, p) for _, p in params)
        out["never_none"] = all(p.grad is None for p in never.parameters())
    reducer.remove()
    locals_ = [_local_grads(model, unused, r) for r in range(hvd.size())]
    ref = {k: sum(loc[k] for loc in locals_) * scale for k in locals_[0]}
    for step in range(2):
        grads = out[f"grads{step}"] if step == 0 else out.pop(f"grads{step}")
        out[f"err{step}"] = _max_err(grads, ref)
    out["w0"] = out.pop("grads0")["0.weight"].tolist()
    return out


def _in_bucket(reducer, p) -> bool:
    """``p.grad`` is a view into its bucket's flat buffer (no separate gradient storage)."""
    flat = reducer._slot[id(p)][0].flat
    start, ptr = flat.data_ptr(), p.grad.data_ptr()
    return start <= ptr < start + flat.numel() * flat.element_size()


def _max_err(grads: dict, ref: dict) -> float:
    return max(float((grads[n] - ref[n]).abs().max()) for n in grads)


def _accumulation_and_frozen(hvd) -> dict:
    from hvd_trainer.comm import GradientReducer

    model = _model()
    frozen = torch.nn.Parameter(torch.ones(3))
    params = list(model.named_parameters()) + [("frozen", frozen)]
    reducer = GradientReducer(params, world=hvd.get_world())
    frozen.requires_grad_(False)  # frozen after construction: must keep .grad None
    x = torch.ones(1, 4) * (hvd.rank() + 1)
    with reducer.no_sync():
        model(x).sum().backward()
    pending_after_nosync = reducer.pending
    model(2 * x).sum().backward()  # synced micro-batch: accumulated grads are averaged
    reducer.wait()
    return {
        "acc_bias": model[2].bias.grad.tolist(),
        "frozen_grad_is_none": frozen.grad is None,
        "pending_after_nosync": pending_after_nosync,
        "pending_after_wait": reducer.pending,
    }


def _process_set_case(hvd) -> dict:
    from hvd_trainer.comm import GradientReducer

    solo = hvd.ProcessSet([0])
    p = torch.nn.Parameter(torch.zeros(2))
    reducer = GradientReducer([("p", p)], world=hvd.get_world(), process_set=solo)
    (p * (hvd.rank() + 1.0)).sum().backward()
    reducer.wait()
    return {"set_grad": p.grad.tolist(), "set_hooks": len(reducer._handles)}


def _layout_mismatch(hvd) -> dict:
    from hvd_trainer.comm import GradientReducer

    model = _model()
    if hvd.rank() == 1:
        model[0].bias.requires_grad_(False)  # a parameter that requires grad on one rank only
    reducer = GradientReducer(list(model.named_parameters()), world=hvd.get_world())
    t0 = time.monotonic()
    try:
        model(torch.ones(1, 4)).sum().backward()
        reducer.wait()
        return {"layout_error": None}
    except hvd.CollectiveMismatchError as exc:
        return {"layout_error": str(exc), "layout_seconds": time.monotonic() - t0}


def _copy_path_case(hvd, side: int) -> dict:
    """Two ``side x side`` weights, three steps: ``.grad`` set to None twice, then zeroed in place
    (autograd accumulates into the bucket view). ``side=256`` (256 KiB each) takes the per-tensor
    fused copy-and-scale; ``side=8`` the one multi-tensor copy plus a bucket-wide scale."""
    from hvd_trainer.comm import GradientReducer

    ws = [torch.nn.Parameter(torch.zeros(side, side)) for _ in range(2)]
    reducer = GradientReducer([(f"w{i}", w) for i, w in enumerate(ws)], world=hvd.get_world())
    errs = []
    for step, to_none in enumerate((True, True, False)):
        for w in ws:
            if to_none:
                w.grad = None
            elif w.grad is not None:
                w.grad.zero_()
        c = hvd.rank() + 1.0 + step
        sum((w * c * (i + 1)).sum() for i, w in enumerate(ws)).backward()
        reducer.wait()
        mean_c = sum(r + 1.0 + step for r in range(hvd.size())) / hvd.size()
        errs.append(max(float((w.grad - mean_c * (i + 1)).abs().max()) for i, w in enumerate(ws)))
    out = {"fuse_scale": [b.fuse_scale for b in reducer._buckets], "errs": errs,
           "views": all(_in_bucket(reducer, w) for w in ws)}
    reducer.remove()
    return out


def _after_backward_case(hvd) -> dict:
    """A bucket that cannot launch during backward (a parameter unused on rank 1): right after
    ``backward()`` every produced ``.grad`` is already its bucket view, so a reference taken then
    holds the average after ``wait()`` (Horovod reduces ``p.grad`` in place)."""
    from hvd_trainer.comm import GradientReducer

    torch.manual_seed(0)
    extra, used = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    named = [(f"extra.{n}", p) for n, p in extra.named_parameters()]
    named += [(f"used.{n}", p) for n, p in used.named_parameters()]
    reducer = GradientReducer(named, world=hvd.get_world())  # one bucket: extra is in it
    x = torch.ones(2, 4) * (hvd.rank() + 1)
    loss = used(x).sum() + (extra(x).sum() if hvd.rank() == 0 else 0.0)
    loss.backward()
    refs = {n: p.grad for n, p in named if p.grad is not None}
    views = all(_in_bucket(reducer, p) for n, p in named if n in refs)
    reducer.wait()
    n = hvd.size()
    # d/dW of sum(W x + b) over 2 rows: every weight entry 2 * (rank + 1), every bias entry 2
    expected = {"used.weight": sum(2.0 * (r + 1) for r in range(n)) / n, "used.bias": 2.0,
                "extra.weight": 2.0 / n, "extra.bias": 2.0 / n}
    err = max(float((ref - expected[k]).abs().max()) for k, ref in refs.items())
    reducer.remove()
    return {"refs": sorted(refs), "views_after_backward": views, "ref_err": err,
            "refs_are_grads": all(refs[k] is p.grad for k, p in named if k in refs)}


def _large_adopted_at_hook(hvd) -> dict:
    """Large gradients go into their bucket as their hook fires, even when the bucket cannot
    launch during backward (``spare`` gets no gradient): autograd's own gradient tensors are not
    held until the end of backward. A hook registered after the reducer's sees the bucket view."""
    from hvd_trainer.comm import GradientReducer

    ws = [torch.nn.Parameter(torch.zeros(256, 256)) for _ in range(3)]  # 256 KiB each
    spare = torch.nn.Parameter(torch.zeros(256, 256))
    named = [("spare", spare)] + [(f"w{i}", w) for i, w in enumerate(ws)]
    reducer = GradientReducer(named, world=hvd.get_world())  # one 1 MiB bucket
    seen: list[bool] = []
    for w in ws:  # post-accumulate hooks run in registration order: after the reducer's
        w.register_post_accumulate_grad_hook(lambda p: seen.append(_in_bucket(reducer, p)))
    sum((w * (i + 1.0)).sum() for i, w in enumerate(ws)).backward()
    reducer.wait()
    err = max(float((w.grad - (i + 1.0)).abs().max()) for i, w in enumerate(ws))
    out = {"buckets": len(reducer.bucket_sizes_bytes), "seen": seen, "err": err}
    reducer.remove()
    return out


def _sparse_and_create_graph(hvd) -> dict:
    """A sparse Embedding gradient is reduced densely in its bucket; a ``create_graph=True``
    backward before the optimizer's first ``synchronize()`` (the reducer is built then, copying
    gradients that require grad)."""
    from hvd_trainer.comm import GradientReducer

    emb = torch.nn.Embedding(4, 2, sparse=True)
    reducer = GradientReducer(list(emb.named_parameters()), world=hvd.get_world())
    emb(torch.tensor([hvd.rank() % 4])).sum().backward()  # row r gets ones on rank r
    reducer.wait()
    dense = emb.weight.grad.to_dense()
    n = hvd.size()
    sparse_err = max(abs(float(dense[r].max()) - 1.0 / n) for r in range(min(n, 4)))
    reducer.remove()
    p = torch.nn.Parameter(torch.ones(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("p", p)])
    ((p * (hvd.rank() + 1.0)) ** 2).sum().backward(create_graph=True)
    opt.synchronize()
    expected = sum(2.0 * (r + 1) ** 2 for r in range(n)) / n  # d/dp (c p)^2 = 2 c^2 p, p = 1
    return {"sparse_err": sparse_err, "sparse_grad_dense": not emb.weight.grad.is_sparse,
            "create_graph_err": float((p.grad - expected).abs().max())}


def _fusion_checks() -> dict:
    import hvd_trainer as hvd
    from hvd_trainer.comm import FusionConfig, GradientReducer

    out = {
        "avg0": _reference_case(hvd, 0, 0.5),
        "avg1m": _reference_case(hvd, 1 << 20, 0.5),
        "sum_scaled": _reference_case(hvd, 1 << 20, 1.0, op=hvd.Sum, prescale_factor=2.0,
                                      postscale_factor=0.5),
        "bf16": _reference_case(hvd, 1 << 20, 0.5, compression=hvd.Compression.bf16),
        "fp16": _reference_case(hvd, 1 << 20, 0.5, compression=hvd.Compression.fp16),
    }
    big = [(f"w{i}", torch.nn.Parameter(torch.zeros(256, 256))) for i in range(4)]  # 256 KiB each
    r = GradientReducer(big, world=hvd.get_world(),
                        config=FusionConfig(fusion_threshold_bytes=1 << 20, first_bucket_bytes=300 << 10))
    out["bucket_sizes"] = r.bucket_sizes_bytes
    out["bucket_names"] = r.bucket_names
    r.remove()
    out["copy_large"] = _copy_path_case(hvd, 256)
    out["copy_small"] = _copy_path_case(hvd, 8)
    out["rank"] = hvd.rank()
    out["after_backward"] = _after_backward_case(hvd)
    out.update(_sparse_and_create_graph(hvd))
    out["large_at_hook"] = _large_adopted_at_hook(hvd)
    out.update(_accumulation_and_frozen(hvd))
    out.update(_process_set_case(hvd))
    out.update(_layout_mismatch(hvd))  # last: leaves a collective unfinished on purpose
    return out


def _check_case(case: dict, tol: float = 1e-6) -> None:
    assert case["err0"] <= tol and case["err1"] <= tol, (case["err0"], case["err1"])
    assert case["views"]
    assert case["never_none"]


def test_fused_reducer() -> None:
    results = run_workers(_fusion_checks, 2, timeout_seconds=150)
    for res in results:
        _check_case(res["avg0"])
        assert res["avg0"]["n_buckets"] == 8
        _check_case(res["avg1m"])
        assert res["avg1m"]["n_buckets"] == 1
        _check_case(res["sum_scaled"])
        for key, fused in (("copy_large", True), ("copy_small", False)):
            case = res[key]
            assert set(case["fuse_scale"]) == {fused}, case
            assert max(case["errs"]) <= 1e-6 and case["views"], case
        ab = res["after_backward"]
        expected_refs = ["used.bias", "used.weight"]
        if res["rank"] == 0:  # extra is unused on rank 1: no gradient there, so no reference
            expected_refs += ["extra.bias", "extra.weight"]
        assert ab["refs"] == sorted(expected_refs), ab
        assert ab["views_after_backward"] and ab["refs_are_grads"] and ab["ref_err"] <= 1e-6, ab
        assert res["sparse_err"] <= 1e-6 and res["sparse_grad_dense"], res
        assert res["create_graph_err"] <= 1e-5, res
        large = res["large_at_hook"]
        assert large["buckets"] == 1 and large["seen"] == [True] * 3 and large["err"] <= 1e-6, large
        _check_case(res["bf16"], tol=5e-2)
        _check_case(res["fp16"], tol=5e-3)
        # first bucket capped at 300 KiB (one 256 KiB tensor), the rest at 1 MiB
        assert res["bucket_sizes"] == [256 << 10, 768 << 10]
        assert res["bucket_names"] == [["w3"], ["w2", "w1", "w0"]]
        # last-layer bias grad = 1 per batch row: two 1-row micro-batches accumulate to 2 on
        # every rank (1 if no_sync lost the first micro-batch); their average is 2
        assert res["acc_bias"] == [2.0, 2.0]
        assert res["frozen_grad_is_none"] and res["pending_after_nosync"] is False
        assert res["pending_after_wait"] is False
        error = res["layout_error"]
        assert error is not None and "0.bias" in error and "HINT" in error, error
        assert "rank 0 = " in error and "rank 1 = " in error
        assert res["layout_seconds"] < 30
    assert results[0]["avg1m"]["w0"] == results[1]["avg1m"]["w0"]  # bit-identical across ranks
    assert results[0]["set_grad"] == [1.0, 1.0] and results[0]["set_hooks"] == 1
    assert results[1]["set_grad"] == [2.0, 2.0] and results[1]["set_hooks"] == 0

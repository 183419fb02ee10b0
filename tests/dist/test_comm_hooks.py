"""DDP's communication hooks run unchanged on hvd_trainer's bucket seam, on 2 gloo processes.

torch's own hooks (``allreduce_hook``, ``bf16_compress_hook``, ``fp16_compress_wrapper``,
``powerSGD_hook``) are registered on the fused reducer and, beside it in the same processes, on a
``torch.nn.parallel.DistributedDataParallel`` copy of the same model fed the same batches: the
averaged gradients must equal DDP's at every step (and, for the exact hooks, the average of the
ranks' local gradients computed in one process). A hook that returns no future, or a future of the
wrong size, fails with a clear error on every rank. The front ends: the torch
``DistributedOptimizer.register_comm_hook`` (with gradient accumulation and a predivide factor)
and ``HorovodStrategy(ddp_comm_hook=...)`` in a real Trainer land on the single-process weights;
the options a hook would override are refused.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist._lightning_cases import TORCHRUN_ENV, fit_pair
from tests.multiproc import run_workers

STEPS = 4


def _model(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    if layers == 1:
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh())
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g)


def _local_average(model: torch.nn.Module, step: int, size: int) -> dict[str, torch.Tensor]:
    """The average over ranks of each rank's local gradient, computed in this one process."""
    grads: dict[str, torch.Tensor] = {}
    for r in range(size):
        model.zero_grad(set_to_none=True)
        model(_batch(step, r)).pow(2).sum().backward()
        for n, p in model.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad / size
    model.zero_grad(set_to_none=True)
    return grads


def _hook_case(hvd, name: str) -> dict:
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel

    from hvd_trainer.comm import FusionConfig, GradientReducer

    def make() -> tuple:
        if name == "powersgd":  # error feedback and warm start: compressed from the 2nd step
            state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                           start_powerSGD_iter=2, random_seed=7)
            return state, powersgd.powerSGD_hook
        hooks = {"allreduce": default.allreduce_hook, "bf16": default.bf16_compress_hook,
                 "fp16_wrapper": default.fp16_compress_wrapper(default.allreduce_hook)}
        return None, hooks[name]

    # PowerSGD: one bucket (torch's hook waits for a collective inside a gloo callback, so with
    # more buckets in flight than gloo has threads it hangs, in DDP too) and one matrix (its Q is
    # drawn for the bucket's matrices in bucket order, which differs between DDP and us).
    # The others: one parameter per bucket on both sides.
    layers, cap = (1, None) if name == "powersgd" else (2, 0)
    ours, twin, ref = _model(layers), _model(layers), _model(layers)
    ddp = DistributedDataParallel(twin, bucket_cap_mb=None if cap is None else 1e-5)
    state, hook = make()
    if name == "bf16":  # DDP refuses it by name without NCCL; gloo reduces bf16 all the same
        def hook(state, bucket, _bf16=hook):  # noqa: ANN001, ANN202
            return _bf16(state, bucket)
    ddp.register_comm_hook(state, hook)
    reducer = GradientReducer(list(ours.named_parameters()), world=hvd.get_world(),
                              config=FusionConfig(fusion_threshold_bytes=cap, first_bucket_bytes=cap),
                              comm_hook=make())
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_ddp = torch.optim.SGD(twin.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    to_ddp, to_truth = [], []
    for step in range(STEPS):
        x = _batch(step, hvd.rank())
        ours(x).pow(2).sum().backward()
        reducer.wait()
        ddp(x).pow(2).sum().backward()
        truth = _local_average(ref, step, hvd.size())
        to_ddp.append(max(float((p.grad - q.grad).abs().max())
                          for p, q in zip(ours.parameters(), twin.parameters(), strict=True)))
        to_truth.append(max(float((p.grad - truth[n]).abs().max()) for n, p in ours.named_parameters()))
        for n, q in ref.named_parameters():
            q.grad = truth[n].clone()
        for opt in (opt_ours, opt_ddp, opt_ref):
            opt.step()
            opt.zero_grad(set_to_none=True)
    reducer.remove()
    weights = torch.cat([p.detach().flatten() for p in ours.parameters()])
    return {"to_ddp": to_ddp, "to_truth": to_truth, "weights": weights.tolist(),
            "buckets": len(reducer.bucket_sizes_bytes)}


def _powersgd_many_buckets(hvd) -> dict:
    """torch's powerSGD_hook over 4 buckets on gloo (DDP hangs there): it completes, and the
    ranks end with equal weights."""
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd

    from hvd_trainer.comm import FusionConfig, GradientReducer

    model = _model()
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, random_seed=7)
    reducer = GradientReducer(list(model.named_parameters()), world=hvd.get_world(),
                              config=FusionConfig(fusion_threshold_bytes=0, first_bucket_bytes=0),
                              comm_hook=(state, powersgd.powerSGD_hook))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        model(_batch(step, hvd.rank())).pow(2).sum().backward()
        reducer.wait()
        opt.step()
        opt.zero_grad(set_to_none=True)
    reducer.remove()
    return {"buckets": len(reducer.bucket_sizes_bytes), "iter": state.iter,
            "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()}


def _bad_hook_case(hvd, kind: str) -> dict:
    from hvd_trainer.comm import CommValueError, GradientReducer

    def no_future(state, bucket):
        return bucket.buffer()

    def wrong_size(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(torch.zeros(3))
        return fut

    model = _model()
    hook = no_future if kind == "no_future" else wrong_size
    reducer = GradientReducer(list(model.named_parameters()), world=hvd.get_world(), comm_hook=(None, hook))
    try:
        model(_batch(0, hvd.rank())).sum().backward()
        reducer.wait()
    except CommValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def _hook_on_one_rank(hvd) -> dict:
    """A hook registered on rank 0 only: a mismatch error on every rank, naming the hook."""
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default

    from hvd_trainer.comm import GradientReducer

    model = _model()
    hook = (None, default.allreduce_hook) if hvd.rank() == 0 else None
    reducer = GradientReducer(list(model.named_parameters()), world=hvd.get_world(), comm_hook=hook)
    try:
        model(_batch(0, hvd.rank())).sum().backward()
        reducer.wait()
    except hvd.CollectiveMismatchError as exc:
        return {"error": str(exc)}
    return {"error": None}


def _refusals(hvd) -> dict:
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default

    from hvd_trainer.comm import GradientReducer

    out = {}
    p = torch.nn.Parameter(torch.zeros(2))
    for key, kwargs in {"sum": {"op": hvd.Sum}, "bf16": {"compression": hvd.Compression.bf16},
                        "not_pair": {}}.items():
        hook = default.allreduce_hook if key == "not_pair" else (None, default.allreduce_hook)
        try:
            GradientReducer([("p", p)], world=hvd.get_world(), comm_hook=hook, **kwargs).remove()
            out[key] = None
        except ValueError as exc:
            out[key] = str(exc)
    return out


def _torch_optimizer_case(hvd) -> dict:
    """``register_comm_hook`` on the torch DistributedOptimizer, 2 backward passes per step and a
    predivide factor of 2, against SGD on the summed average computed in one process."""
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

    import hvd_trainer.torch as hvd_torch

    model, ref = _model(), _model()
    opt = hvd_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=2, gradient_predivide_factor=2.0)
    opt.register_comm_hook(None, default.allreduce_hook)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        for micro in range(2):
            model(_batch(2 * step + micro, hvd.rank())).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        total = {n: sum(_local_average(ref, 2 * step + m, hvd.size())[n] for m in range(2))
                 for n, _ in ref.named_parameters()}
        for n, p in ref.named_parameters():
            p.grad = total[n]
        ref_opt.step()
    err = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    refused = {}
    post_local = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=2)
    for key, kwargs in {"bf16": {"compression": "bf16"}, "zero": {"zero_stage": 1},
                        "groups": {"groups": 2}, "adasum": {"op": hvd.Adasum}, "post_local": {}}.items():
        other = _model()
        wrapped = hvd_torch.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                                 named_parameters=other.named_parameters(), **kwargs)
        try:
            wrapped.register_comm_hook(post_local if key == "post_local" else None, default.allreduce_hook)
            refused[key] = None
        except hvd_torch.OptimizerConfigError as exc:
            refused[key] = str(exc)
    return {"err": err, "refused": refused, **_after_a_failing_hook(hvd, hvd_torch),
            "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()}


def _after_a_failing_hook(hvd, hvd_torch) -> dict:
    """A hook that raises (on every rank): the error reaches the user, from step() (the first
    synchronize() builds the buckets) and then from backward(); registering mid-step is refused
    with its own hint; after the failed step, zero_grad(), another hook and the next step work."""
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default

    def failing(state, bucket):
        raise RuntimeError("hook failed on purpose")

    model = _model()
    opt = hvd_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    opt.register_comm_hook(None, failing)
    out: dict = {"failures": []}
    model(_batch(0, hvd.rank())).sum().backward()
    try:
        opt.step()
    except RuntimeError as exc:
        out["failures"].append(str(exc))
    opt.zero_grad()
    try:
        model(_batch(1, hvd.rank())).sum().backward()
    except RuntimeError as exc:
        out["failures"].append(str(exc))
    try:
        opt.register_comm_hook(None, default.allreduce_hook)
    except hvd_torch.GradientSyncError as exc:
        out["mid_step"] = str(exc)
    try:
        opt.step()
    except RuntimeError as exc:
        out["failures"].append(str(exc))
    opt.zero_grad()
    opt.register_comm_hook(None, default.allreduce_hook)
    model(_batch(2, hvd.rank())).sum().backward()
    opt.step()
    out["recovered"] = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return out


def _lightning_cases() -> dict:
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd

    exact = fit_pair(strategy_kwargs={"ddp_comm_hook": default.allreduce_hook}, accumulate=2)
    wrapped = fit_pair(strategy_kwargs={"ddp_comm_hook": default.allreduce_hook,
                                        "ddp_comm_wrapper": default.fp16_compress_wrapper})
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, random_seed=3)
    compressed = fit_pair(strategy_kwargs={"ddp_comm_state": state, "ddp_comm_hook": powersgd.powerSGD_hook})
    return {"exact": float(abs(exact["dist"] - exact["ref"]).max()),
            "wrapped": float(abs(wrapped["dist"] - wrapped["ref"]).max()),
            "powersgd": float(abs(compressed["dist"] - compressed["ref"]).max()),
            "powersgd_weights": compressed["dist"].tolist(), "powersgd_iter": state.iter}


def _all_cases() -> dict:
    import hvd_trainer as hvd

    out = {name: _hook_case(hvd, name) for name in ("allreduce", "bf16", "fp16_wrapper", "powersgd")}
    out["powersgd_4_buckets"] = _powersgd_many_buckets(hvd)
    out["torch_optimizer"] = _torch_optimizer_case(hvd)
    out["lightning"] = _lightning_cases()
    out["refusals"] = _refusals(hvd)
    out["wrong_size"] = _bad_hook_case(hvd, "wrong_size")
    out["no_future"] = _bad_hook_case(hvd, "no_future")
    out["one_rank"] = _hook_on_one_rank(hvd)  # last: a mismatch leaves the world out of step
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_all_cases, 2, env=TORCHRUN_ENV, timeout_seconds=200)


@pytest.mark.parametrize("name", ["allreduce", "bf16", "fp16_wrapper", "powersgd"])
def test_ddp_hooks_give_ddps_gradients(results: list[dict], name: str) -> None:
    for res in results:
        case = res[name]
        assert case["buckets"] == (1 if name == "powersgd" else 4), case
        assert max(case["to_ddp"]) <= 1e-6, case["to_ddp"]
        if name == "allreduce":
            assert max(case["to_truth"]) <= 1e-5, case["to_truth"]
        elif name == "powersgd":  # rank 1 from the 2nd step: not the exact average any more
            assert max(case["to_truth"][:1]) <= 1e-5 and max(case["to_truth"][1:]) > 1e-3, case
        else:  # 16-bit wire: close to the exact average, not equal
            assert 0 < max(case["to_truth"]) <= 5e-2, case["to_truth"]
    assert results[0][name]["weights"] == results[1][name]["weights"]


def test_powersgd_hook_over_several_buckets_on_gloo(results: list[dict]) -> None:
    cases = [res["powersgd_4_buckets"] for res in results]
    assert cases[0]["buckets"] == 4 and cases[0]["iter"] == STEPS, cases[0]
    assert cases[0]["weights"] == cases[1]["weights"]


def test_bad_hooks_and_options_are_refused(results: list[dict]) -> None:
    for res in results:
        ref = res["refusals"]
        assert "op=Average" in ref["sum"] and "HINT" in ref["sum"], ref
        assert "compression='bf16'" in ref["bf16"] and "HINT" in ref["bf16"], ref
        assert "pair (state, hook)" in ref["not_pair"], ref
        assert "holds a tensor of 3 elements" in res["wrong_size"]["error"], res["wrong_size"]
        assert "not a future" in res["no_future"]["error"], res["no_future"]
        one_rank = res["one_rank"]["error"]
        assert one_rank is not None and "comm_hook" in one_rank and "allreduce_hook" in one_rank, one_rank


def test_torch_optimizer_register_comm_hook(results: list[dict]) -> None:
    for res in results:
        case = res["torch_optimizer"]
        assert case["err"] <= 1e-5, case["err"]
        refused = case["refused"]
        assert "compression='bf16'" in refused["bf16"] and "HINT" in refused["bf16"], refused
        assert "zero_stage=1" in refused["zero"], refused
        assert "groups" in refused["groups"], refused
        assert "op=Adasum" in refused["adasum"], refused
        assert "PostLocalSGDState" in refused["post_local"] and "LocalSGD" in refused["post_local"], refused
        assert len(case["failures"]) == 3 and all("on purpose" in f for f in case["failures"]), case
        assert "HINT: register the hook before the first backward()" in case["mid_step"], case
    assert results[0]["torch_optimizer"]["weights"] == results[1]["torch_optimizer"]["weights"]
    assert results[0]["torch_optimizer"]["recovered"] == results[1]["torch_optimizer"]["recovered"]


def test_strategy_ddp_comm_hook_in_a_trainer(results: list[dict]) -> None:
    for res in results:
        case = res["lightning"]
        assert case["exact"] <= 1e-5, case  # allreduce_hook: the single-process weights
        assert 0 < case["wrapped"] <= 1e-2, case  # fp16 on the wire: close, not equal
        assert case["powersgd"] > 1e-4 and case["powersgd_iter"] == 5, case  # compressed from step 2
    assert results[0]["lightning"]["powersgd_weights"] == results[1]["lightning"]["powersgd_weights"]


def test_strategy_refuses_what_a_hook_would_override() -> None:
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default
    import torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook as post_local

    from hvd_trainer.strategy import HorovodStrategy, StrategyConfigError

    hook = default.allreduce_hook
    for kwargs, match in (
        ({"ddp_comm_wrapper": default.fp16_compress_wrapper}, "without ddp_comm_hook"),
        ({"ddp_comm_state": object()}, "without ddp_comm_hook"),
        ({"ddp_comm_hook": "allreduce"}, "not callable"),
        ({"ddp_comm_hook": hook, "compression": "bf16"}, "compression='bf16'"),
        ({"ddp_comm_hook": hook, "compression": "auto"}, "compression='auto'"),
        ({"ddp_comm_hook": hook, "sync_every": 4}, "sync_every=4"),
        ({"ddp_comm_hook": hook, "zero_stage": 2}, "zero_stage=2"),
        ({"ddp_comm_hook": post_local.post_localSGD_hook, "ddp_comm_state": post_local.PostLocalSGDState(
            process_group=None, subgroup=None, start_localSGD_iter=10)}, "sync_every=H"),
    ):
        with pytest.raises(StrategyConfigError, match=match):
            HorovodStrategy(**kwargs)

"""ZeRO stages 1 and 2 in the torch DistributedOptimizer, on 2 and 3 processes (gloo).

Every worker also trains the same model in one process on the global batch with a plain torch
optimizer (the unsharded reference) and compares: parameters after K steps within 1e-6,
optimizer-state bytes per rank (exact: the reference's per-element state bytes for the elements
the rank owns, whole parameters or pieces of cut ones, plus scalars per owned entry; by elements
within N-1 elements of 1/N), stage 2's gradient bytes after ``synchronize()``, clipping by the
global norm, accumulation, GradScaler (unscaling the held pieces, the skip on inf in one shard),
a layer no rank uses, checkpoints resumed at another world size, a model dominated by one
weight, an optimizer kept on whole parameters, and the refusal of LBFGS.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_workers

GLOBAL = 6  # rows per step, divisible by 1, 2 and 3 ranks
STEPS = 5
TOL = 1e-6
# Small buckets so the model spans several (balanced ones reduce-scattered, lone large
# parameters allreduced/broadcast).
FUSION = {"fusion_threshold_bytes": 400, "first_bucket_bytes": 200}

OPTIMIZERS = {
    "momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 9), torch.nn.Tanh(),
        torch.nn.Linear(9, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3),
    )


def _batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(GLOBAL, 5, generator=g), torch.randn(GLOBAL, 3, generator=g)


def _local(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    rows = GLOBAL // size
    return t[rank * rows : (rank + 1) * rows]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _wrap(model: torch.nn.Module, opt_name: str, stage: int, **kw):
    import hvd_trainer as hvd
    from hvd_trainer.comm import FusionConfig

    inner = OPTIMIZERS[opt_name](model.parameters())
    return hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                    zero_stage=stage, fusion_config=FusionConfig(**FUSION, autotune=None),
                                    **kw)


def _bytes(state: dict, per_element: bool) -> int:
    """Bytes of the state tensors with one value per element (``per_element``) or of the scalars
    (``step``)."""
    return sum(v.numel() * v.element_size() for v in state.values()
               if isinstance(v, torch.Tensor) and (v.dim() > 0) == per_element)


def _state_bytes_by_name(model: torch.nn.Module, opt: torch.optim.Optimizer,
                         per_element: bool = True) -> dict[str, int]:
    return {n: _bytes(opt.state[p], per_element) for n, p in model.named_parameters()}


def _expected_state_bytes(zero, model: torch.nn.Module, ref: torch.nn.Module, ref_opt) -> int:
    """The reference's state bytes for what this rank owns: per-element state for its elements
    (all of a parameter owned whole, its pieces' of a cut one), scalars once per owned entry."""
    elem, scalar = _state_bytes_by_name(ref, ref_opt), _state_bytes_by_name(ref, ref_opt, False)
    total = 0
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        entries = len(zero.pieces.owned_of(p)) if zero.pieces.is_cut(p) else int(zero.owns(p))
        total += elem[n] // q.numel() * zero.owned_numel(p) + scalar[n] * entries
    return total


def _train_and_compare(opt_name: str, stage: int, clip: float | None, accum: int) -> dict:
    import hvd_trainer as hvd
    from hvd_trainer.comm.zero import state_bytes

    rank, size = hvd.rank(), hvd.size()
    model, ref = _model(), _model()
    opt = _wrap(model, opt_name, stage, backward_passes_per_step=accum)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # Horovod scripts' first call: a no-op here
    ref_opt = OPTIMIZERS[opt_name](ref.parameters())
    grad_bytes_after_sync = []
    for step in range(STEPS):
        for micro in range(accum):
            x, y = _batch(step, micro)
            _loss(model, _local(x, rank, size), _local(y, rank, size)).backward()
            _loss(ref, x, y).backward()
        opt.synchronize()
        grad_bytes_after_sync.append(  # stage 2: a cut parameter's owned pieces hold its part
            sum(g.numel() * g.element_size() for g in
                [p.grad for p in model.parameters() if p.grad is not None]
                + opt.zero_sharding.pieces.owned_grads()))
        if clip is not None:
            if stage == 1:  # every averaged gradient is present: torch's own clip is exact
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            else:  # a rank holds its shard only: the global norm needs the shards' norms
                opt.clip_grad_norm_(clip)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        with opt.skip_synchronize():
            opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    zero = opt.zero_sharding
    per_param = _state_bytes_by_name(ref, ref_opt)
    return {
        "max_diff": float((_flat(model) - _flat(ref)).abs().max()),
        "state_bytes": state_bytes(opt.optimizer),
        "expected_state_bytes": _expected_state_bytes(zero, model, ref, ref_opt),
        "elem_state_bytes": sum(_bytes(st, True) for st in opt.optimizer.state.values()),
        "unsharded_elem_bytes": sum(per_param.values()),
        "bytes_per_element": sum(per_param.values()) // sum(p.numel() for p in ref.parameters()),
        "split": zero.split,
        "cut": sum(zero.pieces.is_cut(p) for p in model.parameters()),
        "owned_numel": {n: zero.owned_numel(p) for n, p in model.named_parameters()},
        "numel": {n: p.numel() for n, p in model.named_parameters()},
        "grad_bytes_after_sync": grad_bytes_after_sync,
        "owned_grad_bytes": sum(zero.owned_numel(p) * p.element_size() for p in model.parameters()),
        "bucket_state_bytes": max(
            sum(per_param[zero.named[i][0]] for i in b.params) for b in zero.plan.buckets
        ),
        "wire_bytes": opt.wire_bytes_sent,
        "buckets": [(b.scatter, list(b.seg_len)) for b in zero.plan.buckets],
        "grad_bytes": sum(p.numel() * 4 for p in model.parameters()),
    }


def _check(results: list[dict], size: int, stage: int) -> None:
    for r in results:
        assert r["max_diff"] <= TOL, r["max_diff"]
        assert r["state_bytes"] == r["expected_state_bytes"]
        share = r["unsharded_elem_bytes"] / size
        assert abs(r["elem_state_bytes"] - share) <= r["bucket_state_bytes"], (r["elem_state_bytes"], share)
        # These per-element optimizers plan by elements (this model's lone large parameters get
        # cut), in both stages.
        assert r["split"] and r["cut"] > 0, r
        if stage == 2:
            assert set(r["grad_bytes_after_sync"]) == {r["owned_grad_bytes"]}
        if stage == 1:  # per step a ring allreduce: 2 (N-1)/N of the gradients' bytes (+ used flags)
            least = STEPS * 2 * (size - 1) * r["grad_bytes"] / size
            assert least <= r["wire_bytes"] <= 1.15 * least, (r["wire_bytes"], least)
    elem = [r["elem_state_bytes"] for r in results]  # by elements: within N-1 elements of 1/N
    assert max(elem) - min(elem) <= (size - 1) * results[0]["bytes_per_element"], elem
    if stage == 2:  # per step and bucket: a scattered bucket's segments (gradients + used flags)
        # each go to their owner from the N-1 others (gloo: point to point); a bucket too unbalanced
        # to scatter is allreduced (2 (N-1)/N of it, from every rank)
        per_step = sum((size - 1) * sum(lens) * 4 if scatter
                       else size * (2 * (size - 1) * sum(lens) * 4 // size)
                       for scatter, lens in results[0]["buckets"])
        assert sum(r["wire_bytes"] for r in results) == STEPS * per_step
        assert per_step >= (size - 1) * results[0]["grad_bytes"]
    assert sum(r["elem_state_bytes"] for r in results) == results[0]["unsharded_elem_bytes"]
    for name, numel in results[0]["numel"].items():  # every element owned once
        assert sum(r["owned_numel"][name] for r in results) == numel, name


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt_name", ["momentum", "adamw"])
def test_parameters_equal_unsharded(opt_name: str, stage: int, size: int) -> None:
    results = run_workers(_train_and_compare, size, args=(opt_name, stage, None, 1), timeout_seconds=180)
    _check(results, size, stage)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2])
def test_clipping_and_accumulation(stage: int) -> None:
    results = run_workers(_train_and_compare, 3, args=("adamw", stage, 0.05, 2), timeout_seconds=180)
    _check(results, 3, stage)


def _large_weight_shares(opt_name: str) -> dict:
    """Issue 30's case: a 256x256 weight holds 77 % of this MLP's parameters. Library defaults
    (buckets, autotune) but ``zero_stage=1``; three AdamW steps against the unsharded run."""
    import hvd_trainer as hvd

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                   torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))

    make = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
            "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
            "adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2)}[opt_name]
    rank, size = hvd.rank(), hvd.size()
    model, ref = mlp(), mlp()
    opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                   zero_stage=1)
    ref_opt = make(ref.parameters())
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 64, generator=g), torch.randint(0, 10, (6,), generator=g)
        rows = slice(rank * 6 // size, (rank + 1) * 6 // size)
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    mine = sum(_bytes(st, True) for st in opt.optimizer.state.values())
    big = model[2].weight
    return {"share": mine / sum(_bytes(st, True) for st in ref_opt.state.values()),
            "max_diff": float((_flat(model) - _flat(ref)).abs().max()),
            "split": opt.zero_sharding.split,
            "big_owned": opt.zero_sharding.owned_numel(big) / big.numel()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("opt_name", ["adamw", "adagrad"])  # Adagrad: state made in its constructor
def test_one_large_weight_is_shared_by_elements(opt_name: str, size: int) -> None:
    results = run_workers(_large_weight_shares, size, args=(opt_name,), timeout_seconds=180)
    assert all(r["split"] and r["max_diff"] <= TOL for r in results), results
    # 1/N within N-1 elements (of ~85,000)
    assert all(abs(r["share"] - 1 / size) < 1e-4 for r in results), [r["share"] for r in results]


@pytest.mark.timeout(120)
def test_an_optimizer_not_per_element_keeps_parameters_whole() -> None:
    # Adafactor factors a matrix's state by rows and columns: parameters stay whole, the large
    # weight on one rank (the limit of whole-parameter plans this test documents).
    results = run_workers(_large_weight_shares, 2, args=("adafactor",), timeout_seconds=100)
    assert not any(r["split"] for r in results) and all(r["max_diff"] <= TOL for r in results)
    assert sorted(r["big_owned"] for r in results) == [0.0, 1.0], results


def _edge_model(case: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if case == "sparse":  # nn.Embedding(sparse=True): a sparse gradient in stage 1
        return torch.nn.Sequential(torch.nn.Embedding(50, 6, sparse=True), torch.nn.Flatten(),
                                   torch.nn.Linear(12, 3))
    if case == "empty":  # a trainable parameter with no elements
        model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        model.register_parameter("empty", torch.nn.Parameter(torch.zeros(0)))
        return model
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 4, 3))
    return model.to(memory_format=torch.channels_last) if case == "channels_last" else model


def _edge_input(case: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    if case == "sparse":
        return torch.randint(0, 50, (GLOBAL, 2), generator=g), torch.randn(GLOBAL, 3, generator=g)
    if case == "empty":
        return torch.randn(GLOBAL, 5, generator=g), torch.randn(GLOBAL, 3, generator=g)
    return torch.randn(GLOBAL, 3, 4, 4, generator=g), torch.randn(GLOBAL, 3, generator=g)


def _by_elements_edge(case: str, stage: int) -> dict:
    """Cases a plan by elements must take: a sparse gradient (densified for the pieces), an
    empty parameter, a channels_last conv weight (not cut: not contiguous), and a layout
    changed after wrapping (a clear error)."""
    import hvd_trainer as hvd
    from hvd_trainer.comm.zero import ZeroLayoutError

    rank, size = hvd.rank(), hvd.size()
    model, ref = _edge_model(case), _edge_model(case)
    make = (lambda p: torch.optim.SGD(p, lr=0.1)) if case == "sparse" else OPTIMIZERS["adamw"]
    opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                   zero_stage=stage)
    ref_opt = make(ref.parameters())
    cut = {n for n, p in model.named_parameters() if opt.zero_sharding.pieces.is_cut(p)}
    if case == "layout_after_wrap":
        model.to(memory_format=torch.channels_last)
    try:
        for step in range(3):
            x, y = _edge_input(case, step)
            _loss(model, _local(x, rank, size), _local(y, rank, size)).backward()
            _loss(ref, x, y).backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    except ZeroLayoutError as exc:
        return {"error": str(exc), "cut": sorted(cut)}
    return {"max_diff": float((_flat(model) - _flat(ref)).abs().max()), "cut": sorted(cut),
            "split": opt.zero_sharding.split}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("case", "stage"), [("sparse", 1), ("empty", 2), ("channels_last", 1),
                                             ("layout_after_wrap", 2)])
def test_by_elements_edge_cases(case: str, stage: int) -> None:
    results = run_workers(_by_elements_edge, 2, args=(case, stage), timeout_seconds=120)
    for r in results:
        if case == "layout_after_wrap":  # the conv weight was cut, then made channels_last
            assert "0.weight" in r["cut"] and "channels_last" in r["error"] and "HINT" in r["error"], r
            continue
        assert r["split"] and r["max_diff"] <= TOL, r
        if case == "sparse":
            assert "0.weight" in r["cut"], r  # the embedding (300 of 339 elements) is cut
        if case == "channels_last":
            assert "0.weight" not in r["cut"], r  # not contiguous: kept whole


# -- checkpoints ---------------------------------------------------------------------------------
CKPT_STEPS, MORE_STEPS = 3, 3


def _global_loss(model: torch.nn.Module, step: int, rank: int, size: int) -> torch.Tensor:
    x, y = _batch(step)
    return _loss(model, _local(x, rank, size), _local(y, rank, size))


def _run_steps(model: torch.nn.Module, opt, first: int, count: int) -> list[float]:
    import hvd_trainer as hvd

    losses = []
    for step in range(first, first + count):
        loss = _global_loss(model, step, hvd.rank(), hvd.size())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(hvd.allreduce(loss.detach(), name="loss")))
    return losses


def _save_then_continue(path: str, stage: int) -> list[float]:
    import hvd_trainer as hvd
    from hvd_trainer.comm.zero import state_bytes

    model = _model()
    opt = _wrap(model, "adamw", stage)
    _run_steps(model, opt, 0, CKPT_STEPS)
    before = state_bytes(opt.optimizer)
    hvd.broadcast_optimizer_state(opt, root_rank=1)  # every rank already agrees: changes nothing
    assert state_bytes(opt.optimizer) == before  # each rank kept its shard only
    opt.consolidate_state_dict(to=0)
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    hvd.barrier()
    return _run_steps(model, opt, CKPT_STEPS, MORE_STEPS)


def _resume(path: str, stage: int) -> list[float]:
    model = _model()
    opt = _wrap(model, "adamw", stage)
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    return _run_steps(model, opt, CKPT_STEPS, MORE_STEPS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoint_resumes_at_another_world_size(tmp_path, stage: int) -> None:
    path = str(tmp_path / "ckpt.pt")
    at_two = run_workers(_save_then_continue, 2, args=(path, stage), timeout_seconds=120)[0]
    full = torch.load(path, weights_only=True)["opt"]
    plain = torch.optim.AdamW(_model().parameters(), lr=0.01, weight_decay=0.1)
    plain.load_state_dict(full)  # a plain torch optimizer loads the consolidated state
    assert len(plain.state) == 8 and all("exp_avg" in s for s in plain.state.values())
    for size in (1, 3):
        resumed = run_workers(_resume, size, args=(path, stage), timeout_seconds=120)[0]
        assert resumed == pytest.approx(at_two, abs=TOL), (size, resumed, at_two)


# -- GradScaler and refusal --------------------------------------------------------------------
def _scaler_skips_inf_in_one_shard() -> dict:
    import hvd_trainer as hvd

    model = _model()
    opt = _wrap(model, "adamw", 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    names = [n for n, _ in model.named_parameters()]
    # A parameter owned by rank 1 gets an inf gradient contribution from rank 0 only.
    victim = next(p for _, p in model.named_parameters()
                  if not opt.zero_sharding.owns(p)) if hvd.rank() == 0 else None
    if victim is not None:
        victim.register_hook(lambda g: g * float("inf"))
    before = _flat(model).clone()
    loss = _global_loss(model, 0, hvd.rank(), hvd.size())
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    skipped = bool(torch.equal(_flat(model), before))
    del names
    return {"skipped": skipped, "scale": scaler.get_scale()}


class _WithSpare(torch.nn.Module):
    """``_model()`` and a layer registered but never called (its gradient stays ``None``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()
        self.spare = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _stage2_pieces_scaled(inf_step: int) -> dict:
    """Stage 2 by elements with Horovod's AMP pattern and a layer no rank uses; on ``inf_step``
    rank 0 sends an inf in a parameter cut between the ranks."""
    import hvd_trainer as hvd

    rank, size = hvd.rank(), hvd.size()
    model, ref = _WithSpare(), _WithSpare()
    opt = _wrap(model, "adamw", 2)
    ref_opt = OPTIMIZERS["adamw"](ref.parameters())
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**6) for _ in range(2)]
    zero = opt.zero_sharding
    cut = next(p for p in model.parameters() if zero.pieces.is_cut(p))
    skipped = []
    for step in range(4):
        x, y = _batch(step)
        boom = step == inf_step and rank == 0
        handle = cut.register_hook(lambda g: g * float("inf")) if boom else None
        before = _flat(model).clone()
        scalers[0].scale(_loss(model, _local(x, rank, size), _local(y, rank, size))).backward()
        opt.synchronize()
        # the owned pieces stand in param_groups with their reduced gradients until the step
        held = [q for g in opt.param_groups for q in g["params"] if q.grad is not None]
        assert zero.pieces.owned_grads() and all(g.data_ptr() in {q.grad.data_ptr() for q in held}
                                                 for g in zero.pieces.owned_grads())
        scalers[0].unscale_(opt)
        with opt.skip_synchronize():
            scalers[0].step(opt)
        scalers[0].update()
        opt.zero_grad()
        skipped.append(bool(torch.equal(_flat(model), before)))
        if handle is not None:
            handle.remove()
        if step != inf_step:  # the reference skips nothing
            scalers[1].scale(_loss(ref, x, y)).backward()
            scalers[1].step(ref_opt)
            scalers[1].update()
            ref_opt.zero_grad()
        assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]
    return {"max_diff": float((_flat(model) - _flat(ref)).abs().max()), "skipped": skipped,
            "scale": scalers[0].get_scale(), "spare_state": model.spare.weight in opt.optimizer.state}


@pytest.mark.timeout(180)
def test_stage2_pieces_unscale_skip_and_unused_layer() -> None:
    results = run_workers(_stage2_pieces_scaled, 2, args=(1,), timeout_seconds=150)
    for r in results:
        assert r["skipped"] == [False, True, False, False], r  # every rank skips the inf step
        assert r["scale"] == 2.0**5 and r["max_diff"] <= TOL, r  # unscaled pieces: exact
        assert not r["spare_state"]


@pytest.mark.timeout(120)
def test_grad_scaler_skips_on_every_rank() -> None:
    results = run_workers(_scaler_skips_inf_in_one_shard, 2, timeout_seconds=90)
    assert [r["skipped"] for r in results] == [True, True]
    assert [r["scale"] for r in results] == [2.0**3, 2.0**3]


def _lbfgs_refused() -> str:
    import hvd_trainer as hvd
    from hvd_trainer.comm.zero import UnshardableOptimizerError

    model = _model()
    try:
        hvd.DistributedOptimizer(torch.optim.LBFGS(model.parameters()),
                                 named_parameters=model.named_parameters(), zero_stage=1)
    except UnshardableOptimizerError as exc:
        return str(exc)
    return "not refused"


@pytest.mark.timeout(120)
def test_non_per_parameter_optimizer_refused() -> None:
    messages = run_workers(_lbfgs_refused, 2, timeout_seconds=60)
    for msg in messages:
        assert "torch.optim.lbfgs.LBFGS" in msg and "line search" in msg and "HINT" in msg


# -- process sets --------------------------------------------------------------------------------
def _process_set_worker() -> dict:
    import hvd_trainer as hvd

    pair = hvd.add_process_set([0, 1])
    rank = hvd.rank()
    model, ref = _model(), _model()
    opt = _wrap(model, "adamw", 2, process_set=pair)
    ref_opt = OPTIMIZERS["adamw"](ref.parameters())
    for step in range(STEPS):
        x, y = _batch(step)
        if rank < 2:  # the pair averages over its two halves of the global batch
            _loss(model, _local(x, rank, 2), _local(y, rank, 2)).backward()
            _loss(ref, x, y).backward()
        else:  # outside the set: local training on its own data, unsharded
            _loss(model, x[:2], y[:2]).backward()
            _loss(ref, x[:2], y[:2]).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return {"max_diff": float((_flat(model) - _flat(ref)).abs().max()),
            "owned": sum(opt.zero_sharding.owned_numel(p) for p in model.parameters()),
            "numel": sum(p.numel() for p in model.parameters())}


@pytest.mark.timeout(180)
def test_process_set_shards_over_its_members_only() -> None:
    results = run_workers(_process_set_worker, 3, timeout_seconds=150)
    assert all(r["max_diff"] <= TOL for r in results), results
    numel = results[0]["numel"]  # every element stepped once in the pair, all on the third rank
    assert results[0]["owned"] + results[1]["owned"] == numel and results[2]["owned"] == numel


def _train_overlapped(stage: int) -> dict:
    """``zero_overlap_exchange=True``: each step's exchange is finished by the next forward's
    module hooks (the exchange is still pending after step(), and the hook is gone once a
    forward has finished it); the result equals the unsharded reference. (A read right after
    step() may or may not see the new values: in-place receives land whenever the transfer
    does; packed segments only at the finish.)"""
    import hvd_trainer as hvd

    rank, size = hvd.rank(), hvd.size()
    model, ref = _model(), _model()
    opt = _wrap(model, "adamw", stage, zero_overlap_exchange=True)
    ref_opt = OPTIMIZERS["adamw"](ref.parameters())
    for step in range(STEPS):
        x, y = _batch(step)
        _loss(model, _local(x, rank, size), _local(y, rank, size)).backward()  # finishes step-1's
        _loss(ref, x, y).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    zero = opt.zero_sharding
    pending_before = zero._pending is not None and zero._hook is not None
    with torch.no_grad():
        model(torch.zeros(1, 5))  # a forward finishes every bucket and removes the hook
    after_forward = float((_flat(model) - _flat(ref)).abs().max())
    hook_removed = zero._hook is None and zero._pending is None
    opt.finish_parameter_exchange()  # a no-op now
    return {"after_forward": after_forward, "pending_before": pending_before,
            "hook_removed": hook_removed, "owned_all": all(zero.owns(p) for p in model.parameters())}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_overlapped_exchange_equals_unsharded(stage: int, size: int) -> None:
    results = run_workers(_train_overlapped, size, args=(stage,), timeout_seconds=200)
    for r in results:
        assert r["pending_before"] and r["hook_removed"]
        assert r["after_forward"] <= TOL, r
        assert not r["owned_all"], r


def _overlap_without_zero() -> str:
    from hvd_trainer.torch import OptimizerConfigError

    try:
        _wrap(_model(), "adamw", 0, zero_overlap_exchange=True)
    except OptimizerConfigError as exc:
        return str(exc)
    return "no error"


def test_overlapped_exchange_needs_zero() -> None:
    (message,) = run_workers(_overlap_without_zero, 1, timeout_seconds=60)
    assert "zero_overlap_exchange=True needs zero_stage=1 or 2" in message


class _Functional(torch.nn.Module):
    """Reads ``head``'s weights functionally (never calls ``head``): with the overlap on, their
    exchange is not finished by a forward hook of theirs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh())
        self.head = torch.nn.Sequential(torch.nn.Linear(16, 9), torch.nn.Linear(9, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        for layer in self.head:
            h = torch.nn.functional.linear(h, layer.weight, layer.bias)
        return h


def _overlap_warnings(functional: bool) -> list[str]:
    import warnings

    import hvd_trainer as hvd

    rank, size = hvd.rank(), hvd.size()
    model = _Functional() if functional else _model()
    opt = _wrap(model, "adamw", 2, zero_overlap_exchange=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x, y = _batch(step)
            _loss(model, _local(x, rank, size), _local(y, rank, size)).backward()
            opt.step()
            opt.zero_grad()
    return [str(w.message) for w in caught if "were not reached" in str(w.message)]


@pytest.mark.timeout(120)
def test_overlap_warns_when_forward_bypasses_a_module() -> None:
    functional = run_workers(_overlap_warnings, 2, args=(True,), timeout_seconds=100)
    assert all(len(w) == 1 and "head." in w[0] for w in functional), functional  # once, named
    plain = run_workers(_overlap_warnings, 2, args=(False,), timeout_seconds=100)
    assert plain == [[], []]

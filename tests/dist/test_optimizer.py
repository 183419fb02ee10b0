"""DistributedOptimizer on 2 processes (gloo): weights equal single-process training on the
global batch, bit-identical across ranks; clipping, accumulation, GradScaler, LR schedulers,
state_dict round trips, sparse gradients and the error paths."""

from __future__ import annotations

import copy
import inspect
import io
import warnings

import pytest
import torch

from tests.multiproc import run_workers

B = 4  # per-rank batch
STEPS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 7), torch.nn.Tanh(),
        torch.nn.Linear(7, 3),
    )


def _batch(step: int, rows: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(rows, 5, generator=g), torch.randn(rows, 3, generator=g)


def _local(x: torch.Tensor, y: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x[rank * B : (rank + 1) * B], y[rank * B : (rank + 1) * B]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _options(mode: str) -> dict:
    import hvd_trainer as hvd

    if mode == "accum":
        return {"backward_passes_per_step": 2}
    if mode == "sum":
        return {"op": hvd.Sum}
    if mode == "predivide":
        return {"gradient_predivide_factor": 4.0}
    if mode == "fp16":
        return {"compression": hvd.comm.Compression.fp16}
    if mode == "fp16_str":  # resolved at construction (it used to fail at the first synchronize)
        return {"compression": "fp16"}
    if mode == "fp16_cls":
        from hvd_trainer.comm.ops.compression import FP16Compressor

        return {"compression": FP16Compressor}
    return {}


def _apply(opt: torch.optim.Optimizer, model: torch.nn.Module, mode: str, distributed: bool) -> None:
    """One optimizer step; ``clip`` clips the (averaged) gradients first, Horovod's way."""
    if mode != "clip":
        opt.step()
        return
    if distributed:
        opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    if distributed:
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()


def _run(kind: str, mode: str, distributed: bool) -> torch.Tensor:
    """Train STEPS steps; ``distributed`` = this rank's half batch through DistributedOptimizer,
    else the global batch (2B rows) on a plain optimizer."""
    import hvd_trainer as hvd

    model = _model()
    inner = OPTIMIZERS[kind](model.parameters())
    lr0 = inner.param_groups[0]["lr"]
    opt = hvd.DistributedOptimizer(
        inner, model.named_parameters(), **_options(mode)
    ) if distributed else inner
    if distributed and mode == "sum":  # a sum over 2 ranks is twice the average
        for group in inner.param_groups:
            group["lr"] /= 2
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if mode == "sched" else None
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(2 if mode == "accum" else 1):
            x, y = _batch(step, 2 * B, m)
            if distributed:
                x, y = _local(x, y, hvd.rank())
            _loss(model, x, y).backward()
        _apply(opt, model, mode, distributed)
        if sched is not None:
            sched.step()
    if sched is not None:
        assert abs(inner.param_groups[0]["lr"] - lr0 * 0.5**STEPS) < 1e-12
    return _flat(model)


def _equivalence_worker(cases: list[tuple[str, str]] | None = None) -> dict:
    out = {}
    cases = [(k, "plain") for k in OPTIMIZERS] + [
        ("momentum", "clip"), ("sgd", "accum"), ("adam", "accum"), ("momentum", "sched"),
        ("adam", "clip"), ("sgd", "sum"),
    ] if cases is None else cases
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on the documented paths
        for kind, mode in cases:
            dist_w = _run(kind, mode, True)
            ref_w = _run(kind, mode, False)
            out[f"{kind}-{mode}"] = (float((dist_w - ref_w).abs().max()), dist_w)
    return out


def _scaler_worker() -> dict:
    """GradScaler on CPU: plain ``scaler.step(opt)`` and Horovod's explicit pattern; an inf
    gradient on rank 1 only makes *both* ranks skip the step and halve the scale."""
    import hvd_trainer as hvd

    results = {}
    for pattern in ("implicit", "explicit", "fused"):
        model, ref = _model(), _model()
        if pattern == "fused":  # the inner optimizer could unscale itself; it must not here
            inner = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
            ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
        else:
            inner = torch.optim.SGD(model.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        opt = hvd.DistributedOptimizer(inner, model.named_parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for step in range(STEPS):
            x, y = _batch(step, 2 * B)
            opt.zero_grad()
            lx, ly = _local(x, y, hvd.rank())
            if step == 1 and hvd.rank() == 1:
                lx = lx.clone()
                lx[0, 0] = float("inf")
            scaler.scale(_loss(model, lx, ly)).backward()
            if pattern == "explicit":
                opt.synchronize()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
                with opt.skip_synchronize():
                    scaler.step(opt)
            else:
                scaler.step(opt)
            scaler.update()
            if step != 1:  # the reference skips the inf step
                ref_opt.zero_grad()
                _loss(ref, x, y).backward()
                ref_opt.step()
            if step == 1:
                results[f"{pattern}-scale-after-inf"] = scaler.get_scale()
        results[f"{pattern}-err"] = float((_flat(model) - _flat(ref)).abs().max())
        results[f"{pattern}-w"] = _flat(model)
    return results


def _semantics_worker() -> dict:
    import hvd_trainer as hvd

    rank, res = hvd.rank(), {}
    # backward_passes_per_step=2: nothing sent on the first pass, sent on the second.
    calls = {"n": 0}
    real_all_reduce = torch.distributed.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls["n"] += 1
        return real_all_reduce(*args, **kwargs)

    torch.distributed.all_reduce = counting_all_reduce
    try:
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), backward_passes_per_step=2)
        counts = []
        for step in range(2):
            for m in range(2):
                x, y = _local(*_batch(step, 2 * B, m), rank)
                before = calls["n"]
                _loss(model, x, y).backward()
                counts.append(calls["n"] - before)
            opt.step()
            opt.zero_grad()
        res["allreduces_per_backward"] = counts
    finally:
        torch.distributed.all_reduce = real_all_reduce

    # An extra backward pass before step() is an error (raised on every rank alike).
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   backward_passes_per_step=2)
    x, y = _local(*_batch(0, 2 * B), rank)
    _loss(model, x, y).backward()
    _loss(model, x, y).backward()
    with pytest.raises(hvd.GradientSyncError, match="backward_passes_per_step=2"):
        _loss(model, x, y).backward()
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()

    # zero_grad() while the reduction is due; then the warning of step() after synchronize().
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters())
    for _ in range(2):
        _loss(model, x, y).backward()
        with pytest.raises(hvd.GradientSyncError, match="HINT"):
            opt.zero_grad()
        opt.step()
        opt.zero_grad()
    _loss(model, x, y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    res["n_warnings"] = len([w for w in caught if "skip_synchronize" in str(w.message)])

    # skip_synchronize() without synchronize() is an error, not a race.
    _loss(model, x, y).backward()
    with pytest.raises(hvd.GradientSyncError, match="before entering"), opt.skip_synchronize():
        opt.step()
    opt.step()
    opt.zero_grad()

    # A parameter used on rank 0 only: no hang, average = rank 0's gradient / 2.
    torch.manual_seed(1)
    a, b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    params = list(a.named_parameters(prefix="a")) + list(b.named_parameters(prefix="b"))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), params)
    xs = torch.ones(2, 3) * (rank + 1)
    loss = a(xs).sum() + (b(xs).sum() if rank == 0 else 0.0)
    loss.backward()
    opt.synchronize()
    res["unused_grad"] = b.weight.grad.clone()  # rank 0: d/dw sum(ones @ w) = [2,2,2]; /2
    res["used_grad"] = a.weight.grad.clone()  # (2 + 4) / 2 = 3
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    # A step skipped after synchronize() (as GradScaler does on inf): the next step reduces.
    a(xs).sum().backward()
    opt.synchronize()
    opt.zero_grad()
    a(xs).sum().backward()
    opt.step()
    res["after_skipped_step"] = a.weight.grad.clone()  # (2 + 4) / 2 = 3
    opt.zero_grad()
    # A group added later is averaged from the next step on.
    c = torch.nn.Linear(3, 1)
    opt.add_param_group({"params": list(c.parameters()), "lr": 0.2})
    (a(xs).sum() + c(xs).sum()).backward()
    opt.step()
    res["added_group_grad"] = c.weight.grad.clone()  # (2 + 4) / 2 = 3

    # state_dict round trip through bytes, continued training equals the uninterrupted run.
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   model.named_parameters())
    for step in range(2):
        opt.zero_grad()
        _loss(model, *_local(*_batch(step, 2 * B), rank)).backward()
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    model2 = _model()
    opt2 = hvd.DistributedOptimizer(torch.optim.Adam(model2.parameters(), lr=0.5),
                                    model2.named_parameters())
    buf.seek(0)
    ckpt = torch.load(buf)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        _loss(m, *_local(*_batch(2, 2 * B), rank)).backward()
        o.step()
    res["resume_equal"] = torch.equal(_flat(model), _flat(model2))
    res["resume_lr"] = opt2.param_groups[0]["lr"]
    # Frozen after construction until after the first synchronize() (which builds the buckets):
    # still averaged once unfrozen, as Horovod registers its hooks at construction.
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt3 = hvd.DistributedOptimizer(torch.optim.SGD([a, b], lr=0.1), [("a", a), ("b", b)])
    a.requires_grad_(False)
    (b * (rank + 1.0)).sum().backward()
    opt3.step()
    res["frozen_grad_none"] = a.grad is None
    opt3.zero_grad()
    a.requires_grad_(True)
    ((a + b) * (rank + 1.0)).sum().backward()
    opt3.synchronize()
    res["unfrozen_grad"] = a.grad.tolist()
    # Frozen at construction, unfrozen after the buckets were built: averaged from then on
    # (Horovod leaves it local and the ranks drift apart).
    c, d = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    c.requires_grad_(False)
    opt4 = hvd.DistributedOptimizer(torch.optim.SGD([c, d], lr=0.1), [("c", c), ("d", d)])
    (d * (rank + 1.0)).sum().backward()
    opt4.step()
    opt4.zero_grad()
    c.requires_grad_(True)
    ((c + d) * (rank + 1.0)).sum().backward()
    opt4.step()
    res["late_unfrozen_grad"] = c.grad.tolist()
    res["late_unfrozen_weight"] = c.detach().tolist()
    return res


class _SparseNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 4, sparse=True)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx).sum(1))


def _sparse_adam(idx: torch.Tensor, rank: int) -> dict:
    """SparseAdam needs sparse gradients: both reduction paths must hand it sparse ones."""
    import hvd_trainer as hvd

    target = torch.randn(2 * B, 4, generator=torch.Generator().manual_seed(4))

    def train(emb: torch.nn.Embedding, opt: torch.optim.Optimizer, rows: slice) -> None:
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(emb(idx[rows]).sum(1), target[rows]).backward()
            opt.step()

    torch.manual_seed(0)
    ref = torch.nn.Embedding(20, 4, sparse=True)
    emb0 = copy.deepcopy(ref)
    train(ref, torch.optim.SparseAdam(ref.parameters(), lr=0.1), slice(0, 2 * B))
    out = {}
    for sparse_as_dense in (False, True):
        emb = copy.deepcopy(emb0)
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                       emb.named_parameters(), sparse_as_dense=sparse_as_dense)
        train(emb, opt, slice(rank * B, (rank + 1) * B))
        out[f"sparse_adam-{sparse_as_dense}"] = float((emb.weight - ref.weight).abs().max())
    # Horovod 0.21's spelling, as its test_sparse_embeddings writes it
    emb = copy.deepcopy(emb0)
    train(emb, hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1), sparse=True),
          slice(rank * B, (rank + 1) * B))
    out["sparse_adam-sparse=True"] = float((emb.weight - ref.weight).abs().max())
    for bad in ({"sparse": True, "sparse_as_dense": True}, {"sparse": "yes"}):
        try:
            hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1), **bad)
            out[f"refused-{bad}"] = "accepted"
        except hvd.OptimizerConfigError as exc:
            out[f"refused-{bad}"] = str(exc)
    return out


def _sparse_worker() -> dict:
    import hvd_trainer as hvd

    rank, res = hvd.rank(), {}
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 20, (2 * B, 3), generator=g)
    idx[:, 0] = 5  # a row touched by both ranks: duplicates must be summed
    target = torch.randn(2 * B, 1, generator=g)
    # reference: dense embedding, global batch, plain SGD
    ref = _SparseNet()
    ref.emb.sparse = False
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(idx), target).backward()
        ref_grad = ref.emb.weight.grad.clone()
        ref_opt.step()
    for sparse_as_dense in (False, True):
        net = _SparseNet()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5),
                                       net.named_parameters(), sparse_as_dense=sparse_as_dense)
        for _ in range(2):
            opt.zero_grad()
            lidx, lt = idx[rank * B : (rank + 1) * B], target[rank * B : (rank + 1) * B]
            torch.nn.functional.mse_loss(net(lidx), lt).backward()
            opt.synchronize()
            grad = net.emb.weight.grad
            res[f"{sparse_as_dense}-is_sparse"] = grad.is_sparse
            # relative to the largest entry: these gradients reach ~30, fp32 spacing there ~2e-6
            res[f"{sparse_as_dense}-grad_err"] = float(
                (grad.to_dense() - ref_grad).abs().max() / ref_grad.abs().max()
            )
            with opt.skip_synchronize():
                opt.step()
        res[f"{sparse_as_dense}-w_err"] = float(
            (_flat(net) - _flat(ref)).abs().max() / _flat(ref).abs().max()
        )
        res[f"{sparse_as_dense}-w"] = _flat(net)
        res[f"{sparse_as_dense}-emb_in_reducer"] = any(
            "emb.weight" in names for names in opt._reducer.bucket_names
        )
    res.update(_sparse_adam(idx, rank))
    # sparse_allreduce directly: a rank without a gradient (None), and no gradient anywhere.
    p = torch.zeros(6, 2)
    mine = torch.sparse_coo_tensor([[1, 4]], torch.ones(2, 2), (6, 2)) if rank == 0 else None
    res["one_sided"] = hvd.sparse_allreduce(mine, like=p, sparse_dim=1, world=hvd.get_world()).to_dense()
    res["empty_nnz"] = hvd.sparse_allreduce(None, like=p, sparse_dim=1, world=hvd.get_world())._nnz()
    return res


def _plain(obj):
    """Tensors as nested lists: tensors sent through the result queue would use shared-memory
    handles that die with the worker."""
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_plain(v) for v in obj)
    return obj


def _all_checks() -> dict:
    return _plain({
        "equiv": _equivalence_worker(),
        "scaler": _scaler_worker(),
        "sem": _semantics_worker(),
        "sparse": _sparse_worker(),
    })


def _reducer_accepts(name: str) -> bool:
    from hvd_trainer.comm import GradientReducer

    return name in inspect.signature(GradientReducer).parameters


def _options_checks(cases: list[tuple[str, str]]) -> dict:
    return _plain(_equivalence_worker(cases))


@pytest.mark.skipif(
    not _reducer_accepts("prescale_factor"), reason="comm GradientReducer has no prescale_factor"
)
def test_gradient_predivide_factor() -> None:
    cases = [("sgd", "predivide"), ("adam", "predivide")]
    results = run_workers(_options_checks, 2, args=(cases,), timeout_seconds=120)
    for case, (err, w0) in results[0].items():
        assert err <= 1e-6, (case, err)
        assert w0 == results[1][case][1]


def _has_fp16_compression() -> bool:
    import hvd_trainer

    comp = getattr(hvd_trainer.comm, "Compression", None)
    return _reducer_accepts("compression") and hasattr(comp, "fp16")


@pytest.mark.skipif(not _has_fp16_compression(), reason="comm layer has no Compression.fp16")
def test_fp16_compression() -> None:
    cases = [("sgd", "fp16"), ("sgd", "fp16_str"), ("sgd", "fp16_cls")]
    results = run_workers(_options_checks, 2, args=(cases,), timeout_seconds=120)
    err, w0 = results[0]["sgd-fp16"]
    assert err <= 1e-3  # gradients rounded to fp16 (11-bit significand) for transport
    assert w0 == results[1]["sgd-fp16"][1]
    for spelling in ("sgd-fp16_str", "sgd-fp16_cls"):  # the same compressor, the same weights
        assert results[0][spelling] == results[0]["sgd-fp16"], spelling
        assert results[1][spelling][1] == results[1]["sgd-fp16"][1], spelling


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_all_checks, 2, timeout_seconds=120)


def test_equivalence_with_single_process(results: list[dict]) -> None:
    for case, (err, w0) in results[0]["equiv"].items():
        assert err <= 1e-6, (case, err)
        assert w0 == results[1]["equiv"][case][1], f"{case}: ranks differ"
    assert results[1]["equiv"]["adam-plain"][0] <= 1e-6


def test_grad_scaler(results: list[dict]) -> None:
    for pattern in ("implicit", "explicit", "fused"):
        for res in results:
            assert res["scaler"][f"{pattern}-err"] <= 1e-6, pattern
            assert res["scaler"][f"{pattern}-scale-after-inf"] == 2.0**9  # skipped + halved
        assert results[0]["scaler"][f"{pattern}-w"] == results[1]["scaler"][f"{pattern}-w"]


def test_semantics(results: list[dict]) -> None:
    for res in results:
        sem = res["sem"]
        # First cycle: reducer built at synchronize (step), so both passes send nothing; from
        # the second cycle on only the second backward sends (overlapping backward).
        assert sem["allreduces_per_backward"][0] == 0
        assert sem["allreduces_per_backward"][1] == 0
        assert sem["allreduces_per_backward"][2] == 0
        assert sem["allreduces_per_backward"][3] >= 1
        assert sem["n_warnings"] == 1
        assert sem["unused_grad"] == [[1.0, 1.0, 1.0]]
        assert sem["used_grad"] == [[3.0, 3.0, 3.0]]
        assert sem["added_group_grad"] == [[3.0, 3.0, 3.0]]
        assert sem["after_skipped_step"] == [[3.0, 3.0, 3.0]]
        assert sem["resume_equal"]
        assert sem["resume_lr"] == 0.01
        assert sem["frozen_grad_none"]
        assert sem["unfrozen_grad"] == [1.5, 1.5, 1.5]  # mean of rank + 1 over 2 ranks
        assert sem["late_unfrozen_grad"] == [1.5, 1.5, 1.5]
        assert sem["late_unfrozen_weight"] == pytest.approx([0.85] * 3)  # 1 - 0.1 * 1.5, every rank


def test_sparse_gradients(results: list[dict]) -> None:
    for res in results:
        sp = res["sparse"]
        assert sp["False-is_sparse"] and not sp["False-emb_in_reducer"]
        assert sp["True-is_sparse"] and sp["True-emb_in_reducer"]
        for mode in ("False", "True"):
            assert sp[f"{mode}-grad_err"] <= 1e-6, mode
            assert sp[f"{mode}-w_err"] <= 1e-6, mode
        expected = [[0.5, 0.5] if row in (1, 4) else [0.0, 0.0] for row in range(6)]
        assert sp["one_sided"] == expected
        assert sp["empty_nnz"] == 0
        assert sp["sparse_adam-False"] <= 1e-6 and sp["sparse_adam-True"] <= 1e-6
        assert sp["sparse_adam-sparse=True"] <= 1e-6
        assert "HINT: keep sparse_as_dense" in sp["refused-{'sparse': True, 'sparse_as_dense': True}"]
        assert "sparse='yes' must be True, False or a dict" in sp["refused-{'sparse': 'yes'}"]
    for mode in ("False", "True"):
        assert results[0]["sparse"][f"{mode}-w"] == results[1]["sparse"][f"{mode}-w"]



def _lbfgs_run(distributed: bool, summed: bool = False) -> tuple[torch.Tensor, list[float], int]:
    """LBFGS for STEPS steps; ``summed``: op=Sum, whose single-process objective is the sum of
    the ranks' losses (the mean loss of each rank's half of the global batch)."""
    import hvd_trainer as hvd

    model = _model().double()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5, line_search_fn="strong_wolfe")
    if distributed:
        opt = hvd.DistributedOptimizer(opt, model.named_parameters(), op=hvd.Sum if summed else hvd.Average)
    evaluations, losses = [0], []
    for step in range(STEPS):
        x, y = _batch(step, 2 * B)
        if distributed:
            x, y = _local(x, y, hvd.rank())

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            evaluations[0] += 1
            opt.zero_grad()
            if summed and not distributed:
                loss = sum(_loss(model, *(t.double() for t in _local(x, y, r))) for r in range(2))
            else:
                loss = _loss(model, x.double(), y.double())
            loss.backward()
            return loss

        losses.append(float(opt.step(closure)))
    return _flat(model), losses, evaluations[0]


def _closure_worker() -> dict:
    import hvd_trainer as hvd
    from hvd_trainer.torch.optimizer import OptimizerConfigError

    res: dict = {}
    w, losses, n = _lbfgs_run(distributed=True)
    w1, losses1, n1 = _lbfgs_run(distributed=False)
    res["lbfgs_err"] = float((w - w1).abs().max())
    res["lbfgs_loss_err"] = max(abs(a - b) for a, b in zip(losses, losses1, strict=True))
    res["lbfgs_evals"], res["lbfgs_evals_single"], res["lbfgs_w"] = n, n1, w
    w, losses, n = _lbfgs_run(distributed=True, summed=True)
    w1, losses1, n1 = _lbfgs_run(distributed=False, summed=True)
    res["lbfgs_sum_err"] = float((w - w1).abs().max())
    res["lbfgs_sum_loss_err"] = max(abs(a - b) for a, b in zip(losses, losses1, strict=True))
    res["lbfgs_sum_evals"] = (n, n1)
    # a closure that returns a non-scalar tensor: averaged element-wise, in its own shape
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    res["vector_loss"] = opt.step(lambda: torch.full((2,), float(hvd.rank()))).tolist()
    # Horovod's pattern: backward before step(closure), a closure that only returns the loss.
    # Its gradients are reduced once (op=Sum would show a second reduction as a factor 2).
    rank = hvd.rank()
    for mode in ("closure", "plain"):
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), op=hvd.Sum)
        for step in range(STEPS):
            opt.zero_grad()
            loss = _loss(model, *_local(*_batch(step, 2 * B), rank))
            loss.backward()
            if mode == "closure":
                got = opt.step(lambda loss=loss: float(loss))
                res["float_loss_type"] = type(got).__name__
            else:
                opt.step()
        res[f"sum-{mode}"] = _flat(model)
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), op=hvd.Adasum)
    try:
        opt.step(lambda: None)
    except OptimizerConfigError as exc:
        res["adasum_error"] = str(exc)
    return _plain(res)


def test_step_with_a_closure_is_distributed_lbfgs_equals_the_single_process_run() -> None:
    """LBFGS (strong Wolfe line search, several closure evaluations per step): the closure's
    gradients and loss are averaged, so every rank takes the steps the single process takes on
    the global batch, with the same number of evaluations."""
    results = run_workers(_closure_worker, 2, timeout_seconds=120)
    for res in results:
        assert res["lbfgs_err"] <= 1e-9, res["lbfgs_err"]
        assert res["lbfgs_loss_err"] <= 1e-9
        assert res["lbfgs_evals"] == res["lbfgs_evals_single"] > STEPS  # the line search ran
        # op=Sum: the loss is summed like the gradients, so the single process on the summed
        # objective is matched
        assert res["lbfgs_sum_err"] <= 1e-9 and res["lbfgs_sum_loss_err"] <= 1e-9, res["lbfgs_sum_err"]
        assert res["lbfgs_sum_evals"][0] == res["lbfgs_sum_evals"][1]
        assert res["vector_loss"] == [0.5, 0.5]
        assert res["sum-closure"] == res["sum-plain"]
        assert res["float_loss_type"] == "float"
        assert "does not take a closure" in res["adasum_error"]
    assert results[0]["lbfgs_w"] == results[1]["lbfgs_w"]

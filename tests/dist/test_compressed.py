"""DistributedOptimizer with Compression.int8 and Compression.powersgd on 2 processes (gloo):
the weights equal a single-process reference of the same quantisation / low-rank steps with two
simulated ranks; the residual is carried across steps (and across backward_passes_per_step);
the error-feedback state is in state_dict and resumes bit-identically."""

from __future__ import annotations

import copy

import pytest
import torch

from hvd_trainer.comm.reduce.compressed import int8 as q8
from hvd_trainer.comm.reduce.compressed.powersgd import initial_q, matrix_shape, orthogonalize_
from tests.multiproc import run_workers

B, WORLD, LR = 4, 2, 0.1
WARM = 2  # "powersgd_warm"'s synchronous warm-up


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _shard(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(B, 16, generator=g), torch.randn(B, 4, generator=g)


def _grads(model: torch.nn.Module, step: int, rank: int, passes: int) -> dict[str, torch.Tensor]:
    model.zero_grad()
    for micro in range(passes):
        x, y = _shard(step, micro, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _compression(mode: str):  # noqa: ANN202
    import hvd_trainer as hvd

    if mode.startswith("int8"):
        return hvd.Compression.int8
    # "powersgd": compressed from the first step; "powersgd_warm": the first WARM steps plain
    return hvd.Compression.powersgd(rank=2, min_compress_numel=0,
                                    sync_warmup_steps=WARM if mode == "powersgd_warm" else 0)


def _train(mode: str, steps: int, passes: int) -> dict:
    import hvd_trainer as hvd
    from hvd_trainer.comm import FusionConfig

    rank = hvd.rank()
    model = _model()
    one_per_bucket = FusionConfig(fusion_threshold_bytes=0, first_bucket_bytes=0, autotune=None)

    def make(m: torch.nn.Module) -> hvd.DistributedOptimizer:
        return hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=LR), named_parameters=m.named_parameters(),
            compression=_compression(mode), backward_passes_per_step=passes, fusion_config=one_per_bucket)

    opt = make(model)

    def run(m: torch.nn.Module, o: hvd.DistributedOptimizer, first: int, n: int) -> list[list[float]]:
        out = []
        for step in range(first, first + n):
            o.zero_grad()
            for micro in range(passes):
                x, y = _shard(step, micro, rank)
                torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            out.append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist())
        return out

    params = run(model, opt, 0, steps)
    state = opt.state_dict()
    comp = state["hvd_trainer"]["compression"]
    result = {"params": params, "residuals": {k: v.tolist() for k, v in comp["residuals"].items()},
              "q": {k: v.tolist() for k, v in comp["q"].items()}}
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(state)
    straight = run(model, opt, steps, 2)
    model2 = _model()
    opt2 = make(model2)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    result["resume_equal"] = run(model2, opt2, steps, 2) == straight
    return result


def _reference(mode: str, steps: int, passes: int) -> dict:
    """Two simulated ranks, the same arithmetic as the reducer, in one process."""
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    res = [{n: torch.zeros_like(p) for n, p in model.named_parameters()} for _ in range(WORLD)]
    qs: dict[str, torch.Tensor] = {}
    params = []
    for step in range(steps):
        grads = [_grads(model, step, r, passes) for r in range(WORLD)]
        avg = {}
        for n in names:
            xs = [grads[r][n] * (1.0 / WORLD) for r in range(WORLD)]
            if mode == "powersgd_warm" and step < WARM:
                avg[n] = xs[0] + xs[1]  # plain fp32 average: no residual, no Q yet
                continue
            if mode.startswith("int8"):
                total = torch.zeros(xs[0].numel())
                for r in range(WORLD):
                    x = xs[r].reshape(-1).float() + res[r][n].reshape(-1)
                    q, s = q8.quantize(x, 256)
                    deq = q8.dequantize(q, s, x.numel())
                    res[r][n] = (x - deq).view(xs[r].shape)
                    total += deq
                avg[n] = total.view(xs[0].shape)
                continue
            shape = matrix_shape(xs[0].shape, 2, 0)
            if shape is None:
                avg[n] = xs[0] + xs[1]
                continue
            ms = [xs[r].reshape(shape) + res[r][n].reshape(shape) for r in range(WORLD)]
            q = qs.get(n, initial_q(n, shape[1], 2, 0, torch.device("cpu")))
            p = orthogonalize_(ms[0] @ q + ms[1] @ q)
            q = ms[0].T @ p + ms[1].T @ p
            approx = p @ q.T
            for r in range(WORLD):
                res[r][n] = (ms[r] - approx / WORLD).view(xs[r].shape)  # each rank's share
            # error feedback's invariant: the residuals sum to what the approximation lost
            lost = ms[0] + ms[1] - approx
            torch.testing.assert_close(sum(res[r][n] for r in range(WORLD)).reshape(shape), lost)
            qs[n] = q
            avg[n] = approx.view(xs[0].shape)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p -= LR * avg[n]
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return {"params": params, "residuals": res, "q": qs}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("mode", "passes"), [("int8", 1), ("int8", 2), ("powersgd", 1),
                                              ("powersgd_warm", 1)])
def test_equals_single_process_reference_with_error_feedback(mode: str, passes: int) -> None:
    """``powersgd_warm``: WARM plain steps, then PowerSGD from a zero residual and the initial
    Q; its resume (after the warm-up) must not warm up again."""
    steps = 3 if mode != "powersgd_warm" else WARM + 2
    results = run_workers(_train, WORLD, args=(mode, steps, passes), timeout_seconds=220)
    ref = _reference(mode, steps, passes)
    if mode == "powersgd_warm":  # the warm-up changes the result: this case can fail without it
        cold = _reference("powersgd", steps, passes)["params"][-1]
        assert (cold - ref["params"][-1]).abs().max() > 1e-3
    for rank, r in enumerate(results):
        for got, want in zip(r["params"], ref["params"], strict=True):
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-6, rtol=0)
        for n, want in ref["residuals"][rank].items():
            if mode.startswith("powersgd") and n not in ref["q"]:
                continue  # sent exactly: no residual
            got = torch.tensor(r["residuals"][n])
            assert got.abs().sum() > 0  # carried to the next step
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        for n, want in ref["q"].items():
            torch.testing.assert_close(torch.tensor(r["q"][n]), want, atol=1e-6, rtol=0)
        assert r["resume_equal"]
    assert results[0]["params"] == results[1]["params"]  # bit-identical on both ranks
    assert results[0]["residuals"] != results[1]["residuals"]  # residuals are per rank


def _auto() -> str:
    import hvd_trainer as hvd

    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(), compression="auto")
    torch.nn.functional.mse_loss(model(*_shard(0, 0, hvd.rank())[:1]), _shard(0, 0, hvd.rank())[1]).backward()
    opt.step()
    return opt.compression.name


@pytest.mark.timeout(120)
def test_auto_compression_on_one_host_is_plain_allreduce() -> None:
    assert run_workers(_auto, WORLD, timeout_seconds=100) == ["none", "none"]


def _overflow() -> dict:
    """A step where one rank's gradient is inf (AMP's GradScaler overflow): every rank gets a
    non-finite reduced gradient (so GradScaler skips the step everywhere) and keeps its residuals
    and Q as they were."""
    import hvd_trainer as hvd

    out = {}
    for mode in ("int8", "powersgd"):
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                       named_parameters=model.named_parameters(),
                                       compression=_compression(mode))
        x, y = _shard(0, 0, hvd.rank())
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        before = copy.deepcopy(opt.state_dict()["hvd_trainer"]["compression"])
        scale = float("inf") if hvd.rank() == 1 else 1.0
        (torch.nn.functional.mse_loss(model(x), y) * scale).backward()
        opt.synchronize()
        skipped = all(not torch.isfinite(p.grad).all() for p in model.parameters())
        opt.zero_grad()
        after = opt.state_dict()["hvd_trainer"]["compression"]
        out[mode] = {"skipped_everywhere": skipped,
                     "kept": all(torch.equal(before[k][n], after[k][n]) for k in ("residuals", "q")
                                 for n in before[k])}
    return out


@pytest.mark.timeout(120)
def test_overflow_step_keeps_the_error_feedback_state() -> None:
    for r in run_workers(_overflow, WORLD, timeout_seconds=100):
        for mode in ("int8", "powersgd"):
            assert r[mode] == {"skipped_everywhere": True, "kept": True}, (mode, r)

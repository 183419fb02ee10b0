"""SyncBatchNorm on 2 processes (gloo, CPU): each rank holds part of a batch; outputs, running
statistics and gradients equal nn.BatchNorm on the whole batch. Its collectives are the comm
layer's checked ones: a rank out of step gets CollectiveMismatchError, on every rank, fast."""

from __future__ import annotations

import copy
import pickle
import time

import pytest
import torch

from tests.multiproc import run_workers

# name: (BatchNorm class, global input shape, rows on rank 0, momentum)
CASES = {
    "1d-NC": (torch.nn.BatchNorm1d, (8, 3), 4, 0.1),
    "1d-NCL-uneven": (torch.nn.BatchNorm1d, (8, 3, 5), 3, 0.1),
    "2d": (torch.nn.BatchNorm2d, (6, 4, 3, 3), 3, 0.3),
    "2d-cumulative": (torch.nn.BatchNorm2d, (6, 4, 3, 3), 2, None),
}


def _case(name: str) -> dict:
    import hvd_trainer as hvd

    cls, shape, rows0, momentum = CASES[name]
    rank = hvd.rank()
    lo, hi = (0, rows0) if rank == 0 else (rows0, shape[0])
    torch.manual_seed(0)
    ref = cls(shape[1], momentum=momentum)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    sync = hvd.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    out: dict = {"type": type(sync).__name__, "err": {}}

    def err(key: str, a: torch.Tensor, b: torch.Tensor) -> None:
        out["err"][key] = max(out["err"].get(key, 0.0), float((a - b).abs().max()))

    for it in range(3):
        g = torch.Generator().manual_seed(it)
        x = torch.randn(shape, generator=g) * 3 + 1
        dy = torch.randn(shape, generator=g)
        xr = x[lo:hi].clone().requires_grad_()
        yr = sync(xr)
        (yr * dy[lo:hi]).sum().backward()
        xf = x.clone().requires_grad_()
        yf = ref(xf)
        (yf * dy).sum().backward()
        err("out", yr, yf[lo:hi])
        err("dx", xr.grad, xf.grad[lo:hi])
        err("running_mean", sync.running_mean, ref.running_mean)
        err("running_var", sync.running_var, ref.running_var)
    # weight/bias gradients are per-rank sums; their sum over ranks is the full-batch gradient
    for pname in ("weight", "bias"):
        total = hvd.allreduce(getattr(sync, pname).grad, op=hvd.Sum)
        err("d" + pname, total, getattr(ref, pname).grad)
    sync.eval()
    ref.eval()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    err("eval", sync(x[lo:hi]), ref(x)[lo:hi])
    out["running"] = sync.running_mean.tolist() + sync.running_var.tolist()
    out["nbt"] = int(sync.num_batches_tracked)
    return out


def _worker() -> dict:
    res = {name: _case(name) for name in CASES}
    # one value per channel over all ranks cannot be normalized: a clear error on every rank
    import hvd_trainer as hvd

    bn = hvd.SyncBatchNorm(2)
    x = torch.randn(1, 2) if hvd.rank() == 0 else torch.randn(0, 2)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(x)
    return res


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 2, timeout_seconds=120)


def _out_of_step_worker() -> dict:
    """Each case: ranks run the layer's collectives out of step; every rank must raise."""
    import hvd_trainer as hvd

    r = hvd.rank()
    bn = hvd.SyncBatchNorm(3)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(r))
    bn(x)  # in step: both ranks
    out: dict = {"world_is_the_global": bn.world is hvd.get_world()}
    copied = copy.deepcopy(bn)  # the copy shares the world (process groups cannot be copied)
    out["copy_shares_world"] = copied.world is bn.world
    out["pickle_drops_world"] = pickle.loads(pickle.dumps(bn)).world is None

    def extra_forward() -> None:  # rank 0 runs one forward more, rank 1 goes on to the loss
        if r == 0:
            bn(x)
        hvd.allreduce(torch.ones(1), name="loss_after_forward")

    def other_collective() -> None:  # rank 1 runs a different collective instead of the forward
        if r == 0:
            bn(x)
        else:
            hvd.allgather(torch.zeros(1, 7), name="other_gather")

    def skipped_backward() -> None:  # rank 1 skips backward (the gradient allreduce)
        xr = x.clone().requires_grad_()
        y = bn(xr)
        if r == 0:
            y.sum().backward()
        hvd.allreduce(torch.ones(1), name="loss_after_backward")

    for label, case in (("extra_forward", extra_forward), ("other_collective", other_collective),
                        ("skipped_backward", skipped_backward)):
        t0 = time.monotonic()
        try:
            case()
            out[label] = ("no error", 0.0)
        except hvd.CollectiveMismatchError as exc:
            out[label] = (str(exc), time.monotonic() - t0)
    return out


OUT_OF_STEP_TEXT = {
    "extra_forward": ["SyncBatchNorm.forward", "loss_after_forward"],
    "other_collective": ["SyncBatchNorm.forward", "other_gather"],
    "skipped_backward": ["SyncBatchNorm.backward", "loss_after_backward"],
}


def test_out_of_step_ranks_raise_a_mismatch_on_every_rank() -> None:
    results = run_workers(_out_of_step_worker, 2, env={"HVD_TEST_PG_TIMEOUT": "60"}, timeout_seconds=120)
    for r, res in enumerate(results):
        assert res["world_is_the_global"] and res["copy_shares_world"] and res["pickle_drops_world"]
        for label, needles in OUT_OF_STEP_TEXT.items():
            message, seconds = res[label]
            for needle in needles:
                assert needle in message, (r, label, message)
            assert "HINT" in message, (r, label)
            assert seconds < 30, (r, label, seconds)  # an error, not a hang until the timeout


@pytest.mark.parametrize("name", list(CASES))
def test_equals_batchnorm_on_global_batch(results: list[dict], name: str) -> None:
    for res in results:
        case = res[name]
        assert case["type"] == "SyncBatchNorm"
        assert case["nbt"] == 3
        for key, value in case["err"].items():
            assert value <= 1e-5, (name, key, value)
    assert results[0][name]["running"] == results[1][name]["running"]  # bit-identical

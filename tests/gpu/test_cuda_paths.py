"""CUDA / NCCL code paths, run where a GPU is present (skipped on CPU-only CI).

One spawned rank (a world of one over NCCL: NCCL refuses two ranks on one GPU, and a lent machine
has one) checks values, not just that nothing crashes:

* collectives on CUDA tensors through NCCL (Average/Sum/Max, fp16 and bf16 compression,
  allgather with a variable first dim, broadcast, grouped allreduce), CPU tensors and objects
  through the gloo side group of an NCCL world;
* the torch ``DistributedOptimizer`` and the hook reducer on a CUDA model equal plain SGD;
* ``SyncBatchNorm`` on CUDA equals ``BatchNorm`` (forward, backward, running stats);
* ``Trainer(strategy="horovod", accelerator="gpu")`` in fp32 equals a single-device fit, and
  ``16-mixed`` / ``bf16-mixed`` runs finish with finite weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.multiproc import run_workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _collectives(out: dict[str, Any]) -> None:
    import hvd_trainer as hvd

    world = hvd.get_world()
    out["backend"], out["device"] = world.backend, str(world.device)
    dev = world.device
    x = torch.arange(6, dtype=torch.float32, device=dev)
    out["avg"] = hvd.allreduce(x).cpu().tolist()
    out["sum"] = hvd.allreduce(x, op=hvd.Sum).cpu().tolist()
    out["max"] = hvd.allreduce(x, op=hvd.Max).cpu().tolist()
    out["fp16"] = hvd.allreduce(x / 3, compression=hvd.Compression.fp16).cpu().tolist()
    out["bf16"] = hvd.allreduce(x / 3, compression=hvd.Compression.bf16).cpu().tolist()
    out["half_in"] = hvd.allreduce(x.half()).dtype == torch.float16
    out["gather"] = hvd.allgather(torch.ones(3, 2, device=dev)).shape
    out["bcast"] = hvd.broadcast(x, 0).cpu().tolist()
    out["grouped"] = [t.cpu().tolist() for t in hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)]
    out["cpu_under_nccl"] = hvd.allreduce(torch.ones(2)).tolist()
    out["object"] = hvd.broadcast_object({"k": 1}, 0)
    out["result_device"] = str(hvd.allreduce(x).device)


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _optimizer(out: dict[str, Any]) -> None:
    import hvd_trainer as hvd

    dev = hvd.get_world().device
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(5, 4, 8, generator=g), torch.randn(5, 4, 2, generator=g)
    results = []
    for distributed in (True, False):
        model = _mlp(1).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if distributed:
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for x, y in zip(xs, ys, strict=True):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev)).backward()
            opt.step()
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]).cpu())
    out["opt_max_diff"] = float((results[0] - results[1]).abs().max())
    start = torch.cat([p.detach().flatten() for p in _mlp(1).parameters()])
    out["opt_moved"] = float((results[0] - start).abs().max())


def _sync_bn(out: dict[str, Any]) -> None:
    import hvd_trainer as hvd

    dev = hvd.get_world().device
    x = torch.randn(6, 3, 5, 5, device=dev)
    diffs = []
    mods = [hvd.SyncBatchNorm(3).to(dev), torch.nn.BatchNorm2d(3).to(dev)]
    grads, ys = [], []
    for m in mods:
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        (y * torch.arange(y.numel(), device=dev).view_as(y)).sum().backward()
        ys.append(y.detach())
        grads.append(xi.grad)
    diffs.append(float((ys[0] - ys[1]).abs().max()))
    diffs.append(float((grads[0] - grads[1]).abs().max()))
    diffs.append(float((mods[0].running_mean - mods[1].running_mean).abs().max()))
    diffs.append(float((mods[0].running_var - mods[1].running_var).abs().max()))
    out["sync_bn_diffs"] = diffs


def _lightning(out: dict[str, Any]) -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import SingleDeviceStrategy
    from torch.utils.data import DataLoader, TensorDataset

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp(2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g))
    flat = {}
    # use_distributed_sampler=False: Lightning's injected DistributedSampler shuffles the training
    # set (as under DDP), which a single-device fit does not; one rank needs no sharding.
    common = dict(accelerator="gpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    single = SingleDeviceStrategy(device=torch.device("cuda", 0))
    runs = (("horovod", "horovod", "32-true"), ("single", single, "32-true"),
            ("fp16", "horovod", "16-mixed"), ("bf16", "horovod", "bf16-mixed"))
    for name, strategy, precision in runs:
        model = Net()
        pl.Trainer(strategy=strategy, precision=precision, **common).fit(
            model, DataLoader(data, batch_size=8)
        )
        flat[name] = torch.cat([p.detach().flatten().float().cpu() for p in model.parameters()])
    out["pl_fp32_diff"] = float((flat["horovod"] - flat["single"]).abs().max())
    out["pl_mixed_finite"] = bool(torch.isfinite(flat["fp16"]).all() and torch.isfinite(flat["bf16"]).all())
    out["pl_mixed_diff"] = [float((flat[k] - flat["single"]).abs().max()) for k in ("fp16", "bf16")]


def _worker() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in (_collectives, _optimizer, _sync_bn, _lightning):
        part(out)
    return out


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return run_workers(_worker, 1, timeout_seconds=300)[0]


def test_collectives_on_cuda_through_nccl(result: dict[str, Any]) -> None:
    assert result["backend"] == "nccl" and result["device"] == "cuda:0"
    x = list(map(float, range(6)))
    assert result["avg"] == result["sum"] == result["max"] == result["bcast"] == x
    np.testing.assert_allclose(result["fp16"], np.arange(6) / 3, atol=2e-3)
    np.testing.assert_allclose(result["bf16"], np.arange(6) / 3, atol=2e-2)
    assert result["half_in"]
    assert tuple(result["gather"]) == (3, 2)
    assert result["grouped"] == [x, [2 * v for v in x]]
    assert result["cpu_under_nccl"] == [1.0, 1.0]
    assert result["object"] == {"k": 1}
    assert result["result_device"] == "cuda:0"


def test_distributed_optimizer_on_cuda_equals_plain_sgd(result: dict[str, Any]) -> None:
    assert result["opt_moved"] > 1e-3
    assert result["opt_max_diff"] <= 1e-6


def test_sync_batchnorm_on_cuda_equals_batchnorm(result: dict[str, Any]) -> None:
    assert max(result["sync_bn_diffs"]) <= 1e-4, result["sync_bn_diffs"]


def test_lightning_gpu_fp32_equals_single_device_and_mixed_precision_runs(result: dict[str, Any]) -> None:
    assert result["pl_fp32_diff"] <= 1e-6
    assert result["pl_mixed_finite"]
    assert max(result["pl_mixed_diff"]) < 0.05, result["pl_mixed_diff"]

"""``Trainer(strategy="horovod", sync_batchnorm=True)`` on CPU/gloo: BatchNorm statistics over
the global batch, so 2 ranks x batch b equal 1 process x batch 2b (weights and running stats)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from tests.dist._lightning_cases import IN_FEATURES, TORCHRUN_ENV, Net, make_data, trainer
from tests.multiproc import run_workers


class BNNet(Net):
    def __init__(self, optimizer: str = "momentum", lr: float = 0.1, init_seed: int = 0) -> None:
        super().__init__(optimizer, lr, init_seed)
        torch.manual_seed(init_seed)
        self.body = nn.Sequential(
            nn.Linear(IN_FEATURES, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)
        )


def _state(module: nn.Module) -> np.ndarray:
    tensors = [t.detach().reshape(-1).double() for t in module.state_dict().values() if t.is_floating_point()]
    return torch.cat(tensors).numpy()


def _worker() -> dict[str, Any]:
    import hvd_trainer
    from hvd_trainer.sync_batchnorm import SyncBatchNorm

    world, steps, b = hvd_trainer.size(), 4, 4
    data = make_data(world * b * steps)
    model = BNNet(init_seed=hvd_trainer.rank())
    t = trainer(distributed=True, max_steps=steps, sync_batchnorm=True)
    sampler = DistributedSampler(data, num_replicas=world, rank=hvd_trainer.rank(), shuffle=False)
    t.fit(model, DataLoader(data, batch_size=b, sampler=sampler))
    converted = any(isinstance(m, SyncBatchNorm) for m in model.modules())
    ref = BNNet(init_seed=0)
    trainer(distributed=False, max_steps=steps).fit(ref, DataLoader(data, batch_size=world * b))
    return {"dist": _state(model), "ref": _state(ref), "converted": converted}


def test_sync_batchnorm_matches_global_batch() -> None:
    results = run_workers(_worker, 2, env=TORCHRUN_ENV, timeout_seconds=180)
    for res in results:
        assert res["converted"]
        assert np.abs(res["dist"] - res["ref"]).max() <= 1e-5
    assert np.array_equal(results[0]["dist"], results[1]["dist"])

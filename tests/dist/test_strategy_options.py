"""Strategy options on 2 gloo processes, each against 1 process with the global batch:

* ``sync_batchnorm=True``: BatchNorm statistics over the global batch, so 2 ranks x batch b equal
  1 process x batch 2b (weights and running stats);
* ``HorovodStrategy(compression="bf16")``: gradients travel as bf16, weights stay within bf16
  rounding of the fp32 reference and bit-identical across ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from hvd_trainer.strategy import HorovodStrategy
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


class _SeesSyncBN(pl.Callback):
    """Records whether the module trains with our SyncBatchNorm (Lightning reverts it after fit)."""

    converted = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        from hvd_trainer.sync_batchnorm import SyncBatchNorm

        self.converted = any(isinstance(m, SyncBatchNorm) for m in pl_module.modules())


def _worker() -> dict[str, Any]:
    import hvd_trainer

    world, steps, b = hvd_trainer.size(), 4, 4
    data = make_data(world * b * steps)
    model = BNNet(init_seed=hvd_trainer.rank())
    seen = _SeesSyncBN()
    t = trainer(distributed=True, max_steps=steps, sync_batchnorm=True, callbacks=[seen])
    sampler = DistributedSampler(data, num_replicas=world, rank=hvd_trainer.rank(), shuffle=False)
    t.fit(model, DataLoader(data, batch_size=b, sampler=sampler))
    converted = seen.converted
    ref = BNNet(init_seed=0)
    trainer(distributed=False, max_steps=steps).fit(ref, DataLoader(data, batch_size=world * b))
    out = {"dist": _state(model), "ref": _state(ref), "converted": converted}

    plain = Net("sgd", init_seed=hvd_trainer.rank())
    t = trainer(distributed=False, max_steps=steps)
    ref_plain = Net("sgd", init_seed=0)
    t.fit(ref_plain, DataLoader(data, batch_size=world * b))
    t = pl.Trainer(
        strategy=HorovodStrategy(compression="bf16"), accelerator="cpu", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        max_steps=steps,
    )
    t.fit(plain, DataLoader(data, batch_size=b, sampler=sampler))
    out["bf16"] = _state(plain)
    out["bf16_ref"] = _state(ref_plain)
    return out


def test_sync_batchnorm_and_bf16_compression_match_the_global_batch() -> None:
    results = run_workers(_worker, 2, env=TORCHRUN_ENV, timeout_seconds=240)
    for res in results:
        assert res["converted"]
        assert np.abs(res["dist"] - res["ref"]).max() <= 1e-5
        err = np.abs(res["bf16"] - res["bf16_ref"]).max()
        assert 0 < err <= 5e-3  # bf16 keeps 8 mantissa bits: close to fp32, not equal
    assert np.array_equal(results[0]["dist"], results[1]["dist"])
    assert np.array_equal(results[0]["bf16"], results[1]["bf16"])

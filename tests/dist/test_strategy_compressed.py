"""HorovodStrategy(compression=int8 / powersgd) in a real Trainer on 2 processes: the ranks stay
bit-identical, the checkpoint holds both ranks' error-feedback residuals, and a resume at an epoch
end lands on the same weights as the uninterrupted run."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from tests.dist._lightning_cases import TORCHRUN_ENV, Net, make_data, trainer, weights
from tests.multiproc import run_workers

WORLD, B = 2, 4


def _worker(tmp: str, compression: str) -> dict[str, Any]:
    import hvd_trainer

    # Net's matrices are small: compress them all (min_compress_numel=0). PowerSGD's warm-up
    # (2 plain steps) ends inside the checkpointed epoch: a resume that lost its count would
    # warm up again and differ.
    kw = {"compression": "int8" if compression == "int8"
          else hvd_trainer.Compression.powersgd(rank=2, min_compress_numel=0, sync_warmup_steps=2)}
    data = make_data(WORLD * B * 4)  # 4 steps per epoch
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=hvd_trainer.rank(), shuffle=False)
    loader = DataLoader(data, batch_size=B, sampler=sampler)
    straight = Net("momentum", init_seed=hvd_trainer.rank())
    trainer(distributed=True, max_epochs=2, strategy_kwargs=kw).fit(straight, loader)
    ckpt = ModelCheckpoint(dirpath=os.path.join(tmp, compression), save_on_train_epoch_end=True,
                           save_top_k=-1)
    first = Net("momentum", init_seed=0)
    trainer(distributed=True, max_epochs=1, strategy_kwargs=kw, callbacks=[ckpt],
            enable_checkpointing=True).fit(first, loader)
    path = ckpt.best_model_path or ckpt.last_model_path
    saved = torch.load(path, weights_only=False)
    per_rank = saved["optimizer_states"][0]["hvd_trainer"]["compression_per_rank"]
    resumed = Net("momentum", init_seed=3)
    trainer(distributed=True, max_epochs=2, strategy_kwargs=kw).fit(resumed, loader, ckpt_path=path)
    return {"straight": weights(straight), "resumed": weights(resumed), "ranks_saved": len(per_rank),
            "residuals_differ": any(not torch.equal(a, per_rank[1]["residuals"][k])
                                    for k, a in per_rank[0]["residuals"].items()),
            "compressor": per_rank[0]["compressor"],
            "norms": [[float(v.norm()) for v in pr["residuals"].values()] for pr in per_rank]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compression", ["int8", "powersgd"])
def test_compressed_strategy_checkpoint_resume(tmp_path: Any, compression: str) -> None:
    results = run_workers(_worker, WORLD, args=(str(tmp_path), compression), env=TORCHRUN_ENV,
                          timeout_seconds=280)
    assert np.array_equal(results[0]["straight"], results[1]["straight"])
    for r in results:
        assert r["ranks_saved"] == WORLD and r["residuals_differ"], r["norms"]
        assert r["compressor"] == ("int8" if compression == "int8" else "powersgd(rank=2)")
        np.testing.assert_array_equal(r["resumed"], r["straight"])


def test_powersgd_with_sync_every_is_rejected_int8_accepted() -> None:
    from hvd_trainer.strategy import HorovodStrategy, StrategyConfigError

    with pytest.raises(StrategyConfigError, match="not built for the outer gradient"):
        HorovodStrategy(sync_every=4, compression="powersgd:2")
    assert HorovodStrategy(sync_every=4, compression="int8").local_steps.compression.name == "int8"

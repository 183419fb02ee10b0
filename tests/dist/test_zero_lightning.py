"""``HorovodStrategy(zero_stage=1|2)`` with a real small Trainer on 2 processes (gloo).

Weights after 5 steps equal the single-process run on the global batch (and the zero_stage=0
run) with Adam and clipping by norm; a ModelCheckpoint holds the full optimizer state (gathered on
rank 0, loadable by a plain torch optimizer), and fit(ckpt_path=...) reshards it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.dist._lightning_cases import TORCHRUN_ENV
from tests.multiproc import run_workers

TOL = 1e-6
SMALL_BUCKETS = {"fusion_threshold_bytes": 600, "first_bucket_bytes": 300}


def _equivalence_worker(stage: int) -> dict[str, Any]:
    from tests.dist._lightning_cases import fit_pair

    zero = fit_pair(optimizer="adam", gradient_clip_val=0.05,
                    strategy_kwargs=dict(zero_stage=stage, **SMALL_BUCKETS))
    plain = fit_pair(optimizer="adam", gradient_clip_val=0.05,
                     strategy_kwargs=dict(zero_stage=0, **SMALL_BUCKETS))
    return {"zero": zero["dist"], "ref": zero["ref"], "stage0": plain["dist"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_weights_equal_unsharded(stage: int) -> None:
    results = run_workers(_equivalence_worker, 2, args=(stage,), env=TORCHRUN_ENV, timeout_seconds=240)
    np.testing.assert_array_equal(results[0]["zero"], results[1]["zero"])
    assert np.abs(results[0]["zero"] - results[0]["ref"]).max() <= TOL
    assert np.abs(results[0]["zero"] - results[0]["stage0"]).max() <= TOL


def _checkpoint_worker(tmp: str, stage: int) -> dict[str, Any]:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, DistributedSampler

    import hvd_trainer
    from hvd_trainer.strategy import HorovodStrategy
    from tests.dist._lightning_cases import Net, make_data

    data = make_data(2 * 4 * 6)
    sampler = DistributedSampler(data, num_replicas=hvd_trainer.size(), rank=hvd_trainer.rank(),
                                 shuffle=False)
    loader = DataLoader(data, batch_size=4, sampler=sampler)

    def fit(steps: int, ckpt_path: str | None = None) -> tuple[pl.Trainer, Net]:
        model = Net("adam")
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp, save_last=True, every_n_train_steps=3)
        t = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                       enable_model_summary=False, max_steps=steps, callbacks=[ckpt],
                       strategy=HorovodStrategy(zero_stage=stage, **SMALL_BUCKETS))
        t.fit(model, loader, ckpt_path=ckpt_path)
        return t, model

    t, _ = fit(3)
    owned_after_fit = len(t.optimizers[0].state)
    t2, model2 = fit(6, ckpt_path=str(Path(tmp) / "last.ckpt"))
    return {"owned_state": owned_after_fit, "resumed_state": len(t2.optimizers[0].state),
            "weights": torch.cat([p.detach().reshape(-1) for p in model2.parameters()]).tolist()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2])
def test_model_checkpoint_holds_full_state(tmp_path: Any, stage: int) -> None:
    results = run_workers(_checkpoint_worker, 2, args=(str(tmp_path), stage), env=TORCHRUN_ENV,
                          timeout_seconds=240)
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=False)
    state = ckpt["optimizer_states"][0]
    from tests.dist._lightning_cases import Net

    plain = torch.optim.Adam(Net("adam").parameters(), lr=0.01)
    plain.load_state_dict(state)  # the full state: every parameter, loadable without hvd_trainer
    assert len(plain.state) == 6 and all("exp_avg" in s for s in plain.state.values())
    # each rank kept only its shard, after the fit and after resuming from the checkpoint
    assert sum(r["owned_state"] for r in results) == 6
    assert [r["resumed_state"] for r in results] == [r["owned_state"] for r in results]
    assert results[0]["weights"] == results[1]["weights"]

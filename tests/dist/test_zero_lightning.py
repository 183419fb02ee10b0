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


def _equivalence_worker(stage: int, overlap: bool = False) -> dict[str, Any]:
    from tests.dist._lightning_cases import fit_pair

    zero = fit_pair(optimizer="adam", gradient_clip_val=0.05,
                    strategy_kwargs=dict(zero_stage=stage, zero_overlap_exchange=overlap,
                                         **SMALL_BUCKETS))
    plain = fit_pair(optimizer="adam", gradient_clip_val=0.05,
                     strategy_kwargs=dict(zero_stage=0, **SMALL_BUCKETS))
    return {"zero": zero["dist"], "ref": zero["ref"], "stage0": plain["dist"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "overlap"), [(1, False), (2, False), (2, True)])
def test_weights_equal_unsharded(stage: int, overlap: bool) -> None:
    results = run_workers(_equivalence_worker, 2, args=(stage, overlap), env=TORCHRUN_ENV,
                          timeout_seconds=240)
    np.testing.assert_array_equal(results[0]["zero"], results[1]["zero"])
    assert np.abs(results[0]["zero"] - results[0]["ref"]).max() <= TOL
    assert np.abs(results[0]["zero"] - results[0]["stage0"]).max() <= TOL


def _checkpoint_worker(tmp: str, stage: int, overlap: bool = False) -> dict[str, Any]:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, DistributedSampler

    import hvd_trainer
    from hvd_trainer.strategy import HorovodStrategy
    from tests.dist._lightning_cases import Net, make_data

    data = make_data(2 * 4 * 6)
    sampler = DistributedSampler(data, num_replicas=hvd_trainer.size(), rank=hvd_trainer.rank(),
                                 shuffle=False)
    loader = DataLoader(data, batch_size=4, sampler=sampler)

    pending_at_batch_end: list[bool] = []
    pending_at_save: list[bool] = []
    split: list[bool] = []  # planned by elements

    class Probe(pl.Callback):
        """Whether an exchange is pending after the step (Lightning runs ModelCheckpoint after
        the other callbacks), and still pending once the checkpoint read the model."""

        @staticmethod
        def _pending(trainer: pl.Trainer) -> bool:
            return any(z._pending is not None for z in trainer.strategy._zero.values())

        def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            pending_at_batch_end.append(self._pending(trainer))
            split.append(all(z.split for z in trainer.strategy._zero.values()))

        def on_save_checkpoint(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            pending_at_save.append(self._pending(trainer))

    def fit(steps: int, ckpt_path: str | None = None) -> tuple[pl.Trainer, Net]:
        model = Net("adam")
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp, save_last=True, every_n_train_steps=3)
        t = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                       enable_model_summary=False, max_steps=steps, callbacks=[ckpt, Probe()],
                       strategy=HorovodStrategy(zero_stage=stage, zero_overlap_exchange=overlap,
                                                **SMALL_BUCKETS))
        t.fit(model, loader, ckpt_path=ckpt_path)
        return t, model

    def state_elements(t: pl.Trainer) -> int:  # per-element state values this rank holds
        return sum(v.numel() for st in t.optimizers[0].state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)

    t, _ = fit(3)
    owned_after_fit = state_elements(t)
    t2, model2 = fit(6, ckpt_path=str(Path(tmp) / "last.ckpt"))
    return {"pending_at_batch_end": pending_at_batch_end, "pending_at_save": pending_at_save,
            "owned_state": owned_after_fit, "resumed_state": state_elements(t2),
            "split": split[-1],
            "weights": torch.cat([p.detach().reshape(-1) for p in model2.parameters()]).tolist()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "overlap"), [(1, True), (2, False), (2, True)])
def test_model_checkpoint_holds_full_state(tmp_path: Any, stage: int, overlap: bool) -> None:
    results = run_workers(_checkpoint_worker, 2, args=(str(tmp_path), stage, overlap),
                          env=TORCHRUN_ENV, timeout_seconds=240)
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=False)
    state = ckpt["optimizer_states"][0]
    from tests.dist._lightning_cases import Net

    net = Net("adam")
    plain = torch.optim.Adam(net.parameters(), lr=0.01)
    plain.load_state_dict(state)  # the full state: every parameter, loadable without hvd_trainer
    assert len(plain.state) == 6 and all("exp_avg" in s for s in plain.state.values())
    # each rank kept only its shard (Adam: by elements, half each within one element), after
    # the fit and after resuming from the checkpoint
    elements = 2 * sum(p.numel() for p in net.parameters())  # exp_avg and exp_avg_sq
    assert sum(r["owned_state"] for r in results) == elements
    assert [r["split"] for r in results] == [True, True]
    assert all(abs(r["owned_state"] - elements / 2) <= 2 for r in results), results
    assert [r["resumed_state"] for r in results] == [r["owned_state"] for r in results]
    assert results[0]["weights"] == results[1]["weights"]
    # last.ckpt is written at step 6's on_train_batch_end, when with overlap that step's
    # exchange is still pending: it holds the parameters every rank has after it
    assert ckpt["global_step"] == 6
    saved = torch.cat([v.reshape(-1) for v in ckpt["state_dict"].values()]).tolist()
    assert saved == results[0]["weights"]
    for r in results:
        # the save finished it (the model's state_dict and the optimizer's consolidation both do)
        assert r["pending_at_save"] and not any(r["pending_at_save"])
        assert all(r["pending_at_batch_end"]) == overlap and any(r["pending_at_batch_end"]) == overlap

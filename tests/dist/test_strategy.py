"""HorovodStrategy on 2 gloo processes with real Lightning Trainers.

Equivalence: 2 ranks x per-rank batch b must give the weights of 1 process x batch 2b
(max abs diff <= 1e-6 in fp32), bit-identical on both ranks.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import TorchCheckpointIO
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from torch.distributed import ReduceOp
from torch.utils.data import DataLoader, DistributedSampler

from tests.dist._lightning_cases import (
    TORCHRUN_ENV,
    FrozenFirstLayerNet,
    Net,
    UnfreezeFirstLayer,
    fit_pair,
    trainer,
    weights,
)
from tests.multiproc import run_workers

TOL = 1e-6


class _CollectiveProbe(pl.Callback):
    """Calls the strategy's collectives from inside a running fit and records the results."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        s, r = trainer.strategy, trainer.global_rank
        self.seen["mean"] = s.reduce(torch.tensor([float(r + 1), 10.0 * r]), reduce_op="mean").tolist()
        self.seen["sum"] = s.reduce(torch.tensor(float(r + 1)), reduce_op="sum").item()
        self.seen["max"] = s.reduce(torch.tensor(float(r + 1)), reduce_op=ReduceOp.MAX).item()
        self.seen["min"] = s.reduce(torch.tensor(float(r + 1)), reduce_op="min").item()
        self.seen["int_mean"] = s.reduce(torch.tensor(r + 2), reduce_op="mean").item()
        self.seen["gather"] = s.all_gather(torch.full((2,), float(r))).tolist()
        self.seen["bcast"] = s.broadcast({"from": r}, src=1)
        self.seen["any"] = s.reduce_boolean_decision(r == 1, all=False)
        self.seen["all"] = s.reduce_boolean_decision(r == 1, all=True)
        self.seen["non_tensor"] = s.reduce(3.5)
        s.barrier("probe")


def _basic_worker() -> dict[str, Any]:
    import hvd_trainer
    from hvd_trainer.strategy import HorovodStrategy

    out: dict[str, Any] = {}
    t = trainer(distributed=True, max_steps=1)
    out["strategy_type"] = type(t.strategy).__name__
    out["is_horovod"] = isinstance(t.strategy, HorovodStrategy)
    out["sampler_kwargs"] = t.strategy.distributed_sampler_kwargs
    probe = _CollectiveProbe()
    t = trainer(distributed=True, max_steps=1, callbacks=[probe])
    from tests.dist._lightning_cases import make_data

    t.fit(Net(init_seed=hvd_trainer.rank()), torch.utils.data.DataLoader(make_data(16), batch_size=4))
    out["probe"] = probe.seen
    out["root_device"] = str(t.strategy.root_device)
    out["sgd"] = fit_pair(optimizer="sgd", steps=5)
    return out


def test_strategy_basics_and_sgd_equivalence() -> None:
    results = run_workers(_basic_worker, 2, env=TORCHRUN_ENV, timeout_seconds=150)
    for rank, out in enumerate(results):
        assert out["strategy_type"] == "HorovodStrategy" and out["is_horovod"]
        assert out["sampler_kwargs"] == {"num_replicas": 2, "rank": rank}
        assert out["root_device"] == "cpu"
        p = out["probe"]
        assert p["mean"] == [1.5, 5.0]  # (1+2)/2, (0+10)/2
        assert p["sum"] == 3.0 and p["max"] == 2.0 and p["min"] == 1.0
        assert p["int_mean"] == 2.5  # integer mean comes back as float: (2+3)/2
        assert p["gather"] == [[0.0, 0.0], [1.0, 1.0]]  # [world, *shape], rank order
        assert p["bcast"] == {"from": 1}
        assert p["any"] is True and p["all"] is False
        assert p["non_tensor"] == 3.5
    # (a) bit-identical across ranks, (b) equal to one process with the global batch
    np.testing.assert_array_equal(results[0]["sgd"]["dist"], results[1]["sgd"]["dist"])
    diff = np.abs(results[0]["sgd"]["dist"] - results[0]["sgd"]["ref"]).max()
    assert diff <= TOL, f"2x4 vs 1x8 SGD max abs diff {diff}"
    # the run changed the weights (a test that cannot pass by doing nothing)
    init = Net(init_seed=0)
    init_w = torch.cat([q.detach().reshape(-1).double() for q in init.parameters()]).numpy()
    assert np.abs(results[0]["sgd"]["dist"] - init_w).max() > 1e-3


# -- equivalence for optimizers, clipping, accumulation, bf16 ------------------------------------
EQUIVALENCE = {
    # name: (fit_pair kwargs, tolerance)
    "momentum": (dict(optimizer="momentum"), TOL),
    "adam": (dict(optimizer="adam"), TOL),
    "clip_norm": (dict(optimizer="sgd", gradient_clip_val=0.05), TOL),
    "clip_value": (
        dict(optimizer="momentum", gradient_clip_val=0.01, gradient_clip_algorithm="value"), TOL
    ),
    "accumulate2": (dict(optimizer="momentum", accumulate=2), TOL),
    # first layer frozen in epoch 0 and unfrozen in epoch 1: the reducer must pick it up
    "unfreeze": (dict(optimizer="sgd", epochs=2, model_cls=FrozenFirstLayerNet,
                      callback_factory=lambda: [UnfreezeFirstLayer(1)]), TOL),
    # one bucket per tensor (6 parameters -> 6 allreduces per step)
    "no_fusion": (dict(optimizer="adam", strategy_kwargs=dict(fusion_threshold_bytes=0,
                                                              first_bucket_bytes=0)), TOL),
    # bf16 autocast rounds matmul inputs to 8 mantissa bits; 2x4 and 1x8 sum the weight
    # gradient over different partitions of the batch, so results agree to bf16 precision only
    # (measured: 1.2e-4 after 5 steps; fp32 cases: <= 6e-8).
    "bf16": (dict(optimizer="sgd", precision="bf16-mixed"), 1e-3),
}


def _equivalence_worker() -> dict[str, Any]:
    from tests.dist._lightning_cases import LaunchCounter

    out: dict[str, Any] = {}
    for name, (kwargs, _) in EQUIVALENCE.items():
        if name in ("accumulate2", "no_fusion"):
            counter = LaunchCounter()
            out[name] = fit_pair(**kwargs, dist_callbacks=[counter])
            out[f"{name}_launches"] = counter.per_batch
        else:
            out[name] = fit_pair(**kwargs)
    return out


def test_equivalence_optimizers_clipping_accumulation_bf16() -> None:
    results = run_workers(_equivalence_worker, 2, env=TORCHRUN_ENV, timeout_seconds=240)
    for name, (_, tol) in EQUIVALENCE.items():
        d0, d1 = results[0][name]["dist"], results[1][name]["dist"]
        np.testing.assert_array_equal(d0, d1, err_msg=f"{name}: ranks differ")
        diff = np.abs(d0 - results[0][name]["ref"]).max()
        assert diff <= tol, f"{name}: 2 ranks x 4 vs 1 x 8 max abs diff {diff} > {tol}"
    # accumulation: the accumulating micro-batch launches no bucket, the stepping one all of them
    launches = results[0]["accumulate2_launches"]
    assert len(launches) == 10 and launches[0::2] == [0] * 5, launches
    assert all(n >= 1 for n in launches[1::2]) and len(set(launches[1::2])) == 1, launches
    assert results[0]["no_fusion_launches"] == [6] * 5


# -- manual optimization with two optimizers -----------------------------------------------------
def _manual_worker() -> dict[str, Any]:
    from tests.dist._lightning_cases import TwoOptimizerNet

    flags: list[bool] = []

    class Recording(TwoOptimizerNet):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            super().training_step(batch, batch_idx)
            if self.trainer.strategy.strategy_name == "horovod":  # not the 1-process reference
                flags[:] = self.frozen_grads_stayed_none

    out = fit_pair(model_cls=Recording, steps=4)
    out["frozen_none"] = list(flags)
    return out


def test_manual_optimization_two_optimizers_toggled() -> None:
    results = run_workers(_manual_worker, 2, env=TORCHRUN_ENV, timeout_seconds=120)
    np.testing.assert_array_equal(results[0]["dist"], results[1]["dist"])
    diff = np.abs(results[0]["dist"] - results[0]["ref"]).max()
    assert diff <= TOL, f"manual optimization 2x4 vs 1x8 max abs diff {diff}"
    # the frozen (toggled-off) optimizer's parameters kept grad=None through the reducer
    for out in results:
        assert out["frozen_none"] and all(out["frozen_none"]), out["frozen_none"]


# -- metrics, validate/test/predict, checkpoints, early stopping, LR scaling ---------------------
class _RecordingIO(TorchCheckpointIO):
    """Counts checkpoint writes on this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.saves = 0

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        self.saves += 1
        super().save_checkpoint(*args, **kwargs)


def _eval_stages(out: dict[str, Any]) -> None:
    import hvd_trainer
    from tests.dist._lightning_cases import EvalNet, make_indexed_data

    data = make_indexed_data(16)
    loader = DataLoader(data, batch_size=8)  # 8 samples per rank -> one batch per rank
    model = EvalNet(init_seed=hvd_trainer.rank() + 3)  # rank 0's weights must win
    t = trainer(distributed=True)
    out["validate"] = t.validate(model, loader, verbose=False)[0]
    out["weights_after_validate"] = weights(model)
    with torch.no_grad():
        logits = model(data.tensors[0])
    out["local_acc"] = float((logits.argmax(1) == data.tensors[1]).double().mean())
    out["test"] = t.test(model, loader, verbose=False)[0]
    preds = t.predict(model, loader)
    mine = [(int(i), row.tolist()) for idx, lg in preds for i, row in zip(idx, lg, strict=True)]
    gathered = sorted(p for rank_preds in hvd_trainer.allgather_object(mine) for p in rank_preds)
    out["predict_indices"] = [i for i, _ in gathered]
    out["predict_max_diff"] = max(
        float(np.abs(np.array(row) - logits[i].numpy()).max()) for i, row in gathered
    )


def _checkpoint_resume(out: dict[str, Any], tmp: str) -> None:
    import hvd_trainer
    from tests.dist._lightning_cases import EvalNet, make_indexed_data

    data = make_indexed_data(32)
    sampler = DistributedSampler(data, num_replicas=2, rank=hvd_trainer.rank(), shuffle=False)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    full = EvalNet("adam", init_seed=1)
    trainer(distributed=True, max_epochs=4).fit(full, loader)
    io = _RecordingIO()
    ckpt = ModelCheckpoint(dirpath=os.path.join(tmp, "ckpt"), save_last=True)
    first = EvalNet("adam", init_seed=1)
    t = trainer(distributed=True, max_epochs=2, callbacks=[ckpt], plugins=[io],
                enable_checkpointing=True)
    t.fit(first, loader)
    out["saves"] = io.saves
    out["last_path"] = ckpt.last_model_path
    resumed = EvalNet("adam", init_seed=9)  # different init: the checkpoint must overwrite it
    trainer(distributed=True, max_epochs=4).fit(resumed, loader, ckpt_path=ckpt.last_model_path)
    out["resume_diff"] = float(np.abs(weights(resumed) - weights(full)).max())
    out["resumed_step"] = resumed.global_step


def _early_stopping(out: dict[str, Any], tmp: str) -> None:
    from tests.dist._lightning_cases import EvalNet, make_indexed_data

    data = make_indexed_data(16)
    loader = DataLoader(data, batch_size=4)
    stop = EarlyStopping(monitor="es_metric", patience=1, mode="min")
    best = ModelCheckpoint(dirpath=os.path.join(tmp, "best"), monitor="es_metric", mode="min")
    t = trainer(distributed=True, max_epochs=6, callbacks=[stop, best], enable_checkpointing=True)
    t.fit(EvalNet(), loader, loader)
    out["stopped_epoch"] = t.current_epoch
    out["best_path"] = best.best_model_path


def _scale_lr(out: dict[str, Any]) -> None:
    from hvd_trainer.strategy import HorovodStrategy
    from tests.dist._lightning_cases import make_data

    class WithScheduler(Net):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=100)]

    model = WithScheduler()
    t = trainer(distributed=True, max_steps=1)
    t2 = pl.Trainer(strategy=HorovodStrategy(scale_lr_by_world_size=True), accelerator="cpu",
                    max_steps=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    t2.fit(model, DataLoader(make_data(16), batch_size=4))
    out["scaled_lr"] = t2.optimizers[0].param_groups[0]["lr"]
    out["scaled_base_lrs"] = t2.lr_scheduler_configs[0].scheduler.base_lrs
    plain = WithScheduler()
    t.fit(plain, DataLoader(make_data(16), batch_size=4))
    out["plain_lr"] = t.optimizers[0].param_groups[0]["lr"]


def _lifecycle_worker(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _eval_stages(out)
    _checkpoint_resume(out, tmp)
    _early_stopping(out, tmp)
    _scale_lr(out)
    return out


def test_metrics_eval_stages_checkpoints_early_stopping(tmp_path: Any) -> None:
    results = run_workers(_lifecycle_worker, 2, args=(str(tmp_path),), env=TORCHRUN_ENV,
                          timeout_seconds=240)
    r0, r1 = results
    init0 = Net(init_seed=3)
    np.testing.assert_array_equal(r0["weights_after_validate"], r1["weights_after_validate"])
    init_w = torch.cat([p.detach().reshape(-1).double() for p in init0.parameters()]).numpy()
    np.testing.assert_array_equal(r0["weights_after_validate"], init_w)  # rank 0's weights
    for out in results:
        for stage, p in (("validate", "val"), ("test", "test")):
            m = out[stage]
            assert m[f"{p}_rank_mean"] == 1.5 and m[f"{p}_rank_sum"] == 3.0
            assert m[f"{p}_rank_max"] == 2.0
            assert m[f"{p}_index_sum"] == sum(range(16))  # every sample once, no duplicates
            assert abs(m[f"{p}_acc"] - out["local_acc"]) < 1e-6  # whole set, all ranks
        assert out["predict_indices"] == list(range(16))
        assert out["predict_max_diff"] < 1e-6
        # checkpoint: written by rank 0 only, resume reproduces the uninterrupted run exactly
        assert out["resume_diff"] == 0.0 and out["resumed_step"] == 16
        assert os.path.exists(out["last_path"])
        # early stopping: rank 1 wanted to stop after epoch 1, so every rank stopped there
        assert out["stopped_epoch"] == 2
        assert out["best_path"] == r0["best_path"] and os.path.exists(out["best_path"])
        assert out["scaled_lr"] == 0.2 and out["scaled_base_lrs"] == [0.2]
        assert out["plain_lr"] == 0.1
    assert r0["saves"] >= 2 and r1["saves"] == 0

"""Lightning 1.x's own HorovodStrategy CPU cases, on Lightning 2.x with ``strategy="horovod"``.

The cases of Lightning 1.x's ``tests_pytorch/models/test_horovod.py`` that run on CPU, written
again for 2 gloo ranks, with values asserted: a plain fit (clip by norm, validation, a
``strategy.reduce`` from inside ``training_step``), gradient accumulation and clip by value
(each equal to one process with the global batch), the implicit strategy from the launcher's
``HOROVOD_*`` variables, two optimizers with LR schedulers (manual optimization; the learning
rates are *not* scaled by the world size unless asked, unlike 1.x), ``all_gather``, logged-result
reduction and a torchmetrics metric synchronised through the strategy.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.dist._lightning_cases import TORCHRUN_ENV, Net, fit_pair, make_data, trainer, weights
from tests.multiproc import run_workers

TOL = 1e-6


class _ReducingNet(Net):
    """Checks, as Lightning 1.x's training script did, that a sum over ranks is the world size."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reduced_sums: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.reduced_sums.append(self.trainer.strategy.reduce(torch.tensor(1.0), reduce_op="sum").item())
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)


def _fit_cases_worker() -> dict[str, Any]:
    import hvd_trainer
    from hvd_trainer.strategy import HorovodStrategy

    out: dict[str, Any] = {}
    # plain fit: clip by norm, a validation loop, strategy.reduce inside training_step
    model = _ReducingNet(init_seed=hvd_trainer.rank())
    t = trainer(distributed=True, max_epochs=1, gradient_clip_val=1.0, limit_train_batches=0.5,
                limit_val_batches=0.5)
    data = make_data(64)
    t.fit(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    out["plain"] = {
        "strategy": type(t.strategy).__name__, "finished": t.state.finished,
        "sums": model.reduced_sums, "weights": weights(model),
        "val_loss": float(t.callback_metrics["val_loss"]),
    }
    out["accumulate"] = fit_pair(steps=3, accumulate=2)
    out["clip_value"] = fit_pair(steps=4, gradient_clip_val=0.01, gradient_clip_algorithm="value")
    out["is_horovod"] = isinstance(t.strategy, HorovodStrategy)
    return out


def test_plain_fit_accumulation_and_clip_by_value() -> None:
    r0, r1 = run_workers(_fit_cases_worker, 2, env=TORCHRUN_ENV, timeout_seconds=150)
    for res in (r0, r1):
        plain = res["plain"]
        assert res["is_horovod"] and plain["strategy"] == "HorovodStrategy" and plain["finished"]
        assert plain["sums"] == [2.0] * 4  # 64 samples / 2 ranks / batch 4 * limit 0.5
        for case in ("accumulate", "clip_value"):
            np.testing.assert_allclose(res[case]["dist"], res[case]["ref"], atol=TOL, rtol=0)
    np.testing.assert_array_equal(r0["plain"]["weights"], r1["plain"]["weights"])
    assert r0["plain"]["val_loss"] == r1["plain"]["val_loss"]
    np.testing.assert_array_equal(r0["clip_value"]["dist"], r1["clip_value"]["dist"])


def _implicit_worker() -> dict[str, Any]:
    import hvd_trainer

    rank, size = hvd_trainer.rank(), hvd_trainer.size()
    # what horovodrun (and hvdrun) export to each worker; Lightning 1.x picked Horovod from them
    os.environ.update({"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
                       "HOROVOD_LOCAL_RANK": str(rank), "HOROVOD_LOCAL_SIZE": str(size)})
    model = Net(init_seed=rank)
    t = pl.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    t.fit(model, DataLoader(make_data(64), batch_size=4))
    return {"strategy": type(t.strategy).__name__, "world_size": t.world_size, "weights": weights(model)}


def test_implicit_strategy_from_horovod_launcher_variables() -> None:
    r0, r1 = run_workers(_implicit_worker, 2, env=TORCHRUN_ENV, timeout_seconds=120)
    assert r0["strategy"] == r1["strategy"] == "HorovodStrategy"
    assert r0["world_size"] == r1["world_size"] == 2
    # gradients were averaged: both ranks trained one model from rank 0's initial weights
    np.testing.assert_array_equal(r0["weights"], r1["weights"])


class _TwoSchedulersNet(Net):
    """Lightning 1.x's multi-optimizer case in 2.x form: two Adam optimizers over the same
    parameters with StepLR(step_size=1, gamma=0.1) each, stepped manually at each epoch end."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        for opt in self.optimizers():
            opt.zero_grad()
            self.manual_backward(F.cross_entropy(self(x), y))
            opt.step()

    def on_train_epoch_end(self) -> None:
        for scheduler in self.lr_schedulers():
            scheduler.step()

    def configure_optimizers(self) -> Any:
        opts = [torch.optim.Adam(self.parameters(), lr=0.1), torch.optim.Adam(self.parameters(), lr=0.1)]
        return opts, [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.1) for o in opts]


def _two_schedulers_worker(scale: bool) -> dict[str, Any]:
    import hvd_trainer

    model = _TwoSchedulersNet(init_seed=hvd_trainer.rank())
    t = trainer(distributed=True, max_epochs=1, strategy_kwargs={"scale_lr_by_world_size": scale})
    # rank-dependent shards: equal weights afterwards show both optimizers' gradients averaged
    t.fit(model, DataLoader(make_data(32, seed=hvd_trainer.rank()), batch_size=4))
    opts = model.optimizers()
    return {"lrs": [o.param_groups[0]["lr"] for o in opts],
            "base_lrs": [s.base_lrs[0] for s in model.lr_schedulers()], "weights": weights(model)}


def test_two_optimizers_with_schedulers_lr_not_scaled_unless_asked() -> None:
    for scale, factor in ((False, 1), (True, 2)):
        r0, r1 = run_workers(_two_schedulers_worker, 2, args=(scale,), env=TORCHRUN_ENV, timeout_seconds=120)
        for res in (r0, r1):
            # one epoch, one StepLR step: 0.1 * gamma (Lightning 1.x: 0.1 * world size * gamma, always)
            np.testing.assert_allclose(res["lrs"], [0.1 * factor * 0.1] * 2, rtol=1e-12)
            np.testing.assert_allclose(res["base_lrs"], [0.1 * factor] * 2, rtol=1e-12)
        np.testing.assert_array_equal(r0["weights"], r1["weights"])


class _GatherReduceNet(Net):
    """all_gather (plain and with gradients), logged-result reduction and a torchmetrics metric."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import torchmetrics

        super().__init__(*args, **kwargs)
        self.seen: dict[str, Any] = {}
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(
            num_classes=4, average="micro", dist_sync_on_step=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        rank = float(self.global_rank)
        gathered = self.all_gather(torch.full((3,), rank))
        leaf = torch.full((2,), rank + 1.0, requires_grad=True)
        with_grads = self.all_gather(leaf, sync_grads=True)
        with_grads.sum().backward()
        self.seen = {"gather": gathered.tolist(), "gather_shape": list(gathered.shape),
                     "with_grads": with_grads.tolist(), "leaf_grad": leaf.grad.tolist()}
        for fx in ("mean", "sum", "max", "min"):
            self.log(f"rank_{fx}", rank + 1.0, sync_dist=True, reduce_fx=fx)
        x, y = batch
        logits = self(x)
        self.seen["step_accuracy"] = float(self.accuracy(logits, y))  # synchronised on this step
        self.seen["preds"] = logits.argmax(-1).tolist()
        self.seen["targets"] = y.tolist()
        return F.cross_entropy(logits, y)


def _gather_reduce_worker() -> dict[str, Any]:
    import hvd_trainer

    model = _GatherReduceNet(lr=0.0, init_seed=0)  # lr 0: the predictions stay fixed
    t = trainer(distributed=True, max_steps=1)
    t.fit(model, DataLoader(make_data(16, seed=hvd_trainer.rank()), batch_size=8))
    out = dict(model.seen)
    out["logged"] = {k: float(v) for k, v in t.callback_metrics.items() if k.startswith("rank_")}
    out["epoch_accuracy"] = float(model.accuracy.compute())
    return out


def test_all_gather_result_reduction_and_metrics() -> None:
    r0, r1 = run_workers(_gather_reduce_worker, 2, env=TORCHRUN_ENV, timeout_seconds=120)
    preds = r0["preds"] + r1["preds"]
    targets = r0["targets"] + r1["targets"]
    expected = sum(p == t for p, t in zip(preds, targets)) / len(targets)
    for res in (r0, r1):
        assert res["gather_shape"] == [2, 3] and res["gather"] == [[0.0] * 3, [1.0] * 3]
        assert res["with_grads"] == [[1.0, 1.0], [2.0, 2.0]]
        assert res["leaf_grad"] == [2.0, 2.0]  # d(sum of both ranks' copies)/d(own), summed over ranks
        assert res["logged"] == {"rank_mean": 1.5, "rank_sum": 3.0, "rank_max": 2.0, "rank_min": 1.0}
        assert abs(res["step_accuracy"] - expected) < 1e-6
        assert abs(res["epoch_accuracy"] - expected) < 1e-6

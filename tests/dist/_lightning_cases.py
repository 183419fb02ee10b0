"""Shared pieces of the Lightning strategy tests: a small model, fixed data, a Trainer factory.

Every case trains the same model on the same data, either with ``strategy="horovod"`` on N
ranks with per-rank batch ``b`` or with a single-device strategy and batch ``N*b``. With
``shuffle=False`` Lightning's DistributedSampler gives rank r the samples ``r, r+N, r+2N, ...``,
so step k of the distributed run sees exactly the samples of step k of the single run. (Lightning
always shuffles an injected training sampler, so the tests pass their own unshuffled one.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hvd_trainer  # noqa: F401  (registers "horovod")

IN_FEATURES = 6
CLASSES = 4
# Worker processes get TORCHELASTIC_RUN_ID, as under hvdrun/torchrun.
TORCHRUN_ENV = {"TORCHELASTIC_RUN_ID": "hvd-test"}


def make_data(n: int, seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return TensorDataset(x, y)


class Net(pl.LightningModule):
    """Three linear layers with biases (6 parameter tensors of mixed sizes)."""

    def __init__(self, optimizer: str = "sgd", lr: float = 0.1, init_seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(init_seed)
        self.body = nn.Sequential(
            nn.Linear(IN_FEATURES, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, CLASSES)
        )
        self.optimizer_name = optimizer
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.optimizer_name == "momentum":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, nesterov=True)
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr * 0.1)
        raise ValueError(self.optimizer_name)


def weights(module: nn.Module) -> np.ndarray:
    """All parameters, flattened, as float64 numpy (picklable across processes)."""
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()]).numpy()


def trainer(*, distributed: bool, strategy_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> pl.Trainer:
    base: dict[str, Any] = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    base.update(kwargs)
    if distributed and strategy_kwargs:
        from hvd_trainer.strategy import HorovodStrategy

        return pl.Trainer(strategy=HorovodStrategy(**strategy_kwargs), **base)
    if distributed:
        return pl.Trainer(strategy="horovod", **base)
    return pl.Trainer(strategy=SingleDeviceStrategy(device="cpu"), devices=1, **base)


class LaunchCounter(pl.Callback):
    """Counts the gradient buckets the strategy's reducer launches during each training batch."""

    def __init__(self) -> None:
        self.per_batch: list[int] = []
        self._count = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        reducer = trainer.strategy.reducer
        launch = reducer._launch

        def counting_launch(bucket: Any) -> None:
            self._count += 1
            launch(bucket)

        reducer._launch = counting_launch  # instance attribute shadows the method

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._count = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.per_batch.append(self._count)


def fit_pair(
    *,
    optimizer: str = "sgd",
    steps: int = 5,
    batch_per_rank: int = 4,
    accumulate: int = 1,
    model_cls: type[Net] = Net,
    dist_callbacks: list[pl.Callback] | None = None,
    strategy_kwargs: dict[str, Any] | None = None,
    epochs: int = 1,
    callback_factory: Any = None,
    **trainer_kwargs: Any,
) -> dict[str, np.ndarray]:
    """Fit on all ranks with per-rank batch b, and locally with batch world*b; return both.

    ``steps`` optimizer steps make one epoch; ``callback_factory()`` (if given) makes callbacks
    for both runs.
    """
    extra = callback_factory if callback_factory is not None else list
    world = hvd_trainer.size()
    n = world * batch_per_rank * steps * accumulate
    data = make_data(n)
    # rank-dependent init: the strategy must broadcast rank 0's weights
    dist_model = model_cls(optimizer, init_seed=hvd_trainer.rank())
    t = trainer(
        distributed=True, max_steps=steps * epochs, accumulate_grad_batches=accumulate,
        callbacks=[*(dist_callbacks or []), *extra()], strategy_kwargs=strategy_kwargs,
        **trainer_kwargs,
    )
    sampler = DistributedSampler(data, num_replicas=world, rank=hvd_trainer.rank(), shuffle=False)
    t.fit(dist_model, DataLoader(data, batch_size=batch_per_rank, sampler=sampler))
    ref_model = model_cls(optimizer, init_seed=0)
    r = trainer(distributed=False, max_steps=steps * epochs, accumulate_grad_batches=accumulate,
                callbacks=extra(), **trainer_kwargs)
    r.fit(ref_model, DataLoader(data, batch_size=world * batch_per_rank, shuffle=False))
    return {"dist": weights(dist_model), "ref": weights(ref_model)}


class TwoOptimizerNet(Net):
    """Manual optimization, GAN-style: two optimizers over disjoint parameter sets, each step
    toggled so the other set's parameters are frozen (their ``.grad`` must stay ``None``)."""

    def __init__(self, optimizer: str = "sgd", lr: float = 0.1, init_seed: int = 0) -> None:
        super().__init__(optimizer, lr, init_seed)
        self.automatic_optimization = False
        self.frozen_grads_stayed_none: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_first, opt_rest = self.optimizers()
        first = list(self.body[0].parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in first)]
        for opt, frozen in ((opt_first, rest), (opt_rest, first)):
            self.toggle_optimizer(opt)
            loss = F.cross_entropy(self(x), y)
            self.manual_backward(loss)
            self.frozen_grads_stayed_none.append(all(p.grad is None for p in frozen))
            opt.step()
            opt.zero_grad()
            self.untoggle_optimizer(opt)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        first = list(self.body[0].parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in first)]
        return [
            torch.optim.SGD(first, lr=self.lr, momentum=0.9),
            torch.optim.Adam(rest, lr=self.lr * 0.1),
        ]


def make_indexed_data(n: int, seed: int = 7) -> TensorDataset:
    """Like :func:`make_data` plus a third tensor: each sample's index (int64)."""
    x, y = make_data(n, seed).tensors
    return TensorDataset(x, y, torch.arange(n))


class EvalNet(Net):
    """Logs rank-dependent values and torchmetrics in validate/test, returns (index, logits)
    from predict, and a deliberately unsynchronised ``es_metric`` for EarlyStopping."""

    def __init__(self, optimizer: str = "sgd", lr: float = 0.1, init_seed: int = 0) -> None:
        super().__init__(optimizer, lr, init_seed)
        from torchmetrics import SumMetric
        from torchmetrics.classification import MulticlassAccuracy

        self.acc = MulticlassAccuracy(num_classes=CLASSES, average="micro")
        self.index_sum = SumMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch[0], batch[1]
        return F.cross_entropy(self(x), y)

    def _eval_step(self, batch: Any, prefix: str) -> None:
        x, y, idx = batch
        value = float(self.global_rank + 1)
        self.log(f"{prefix}_rank_mean", value, sync_dist=True)
        self.log(f"{prefix}_rank_sum", value, sync_dist=True, reduce_fx="sum")
        self.log(f"{prefix}_rank_max", value, sync_dist=True, reduce_fx="max")
        self.acc.update(self(x), y)
        self.index_sum.update(idx.double())
        self.log(f"{prefix}_acc", self.acc)
        self.log(f"{prefix}_index_sum", self.index_sum)
        # rank 0 keeps improving, rank 1 never improves after epoch 0: not synchronised on purpose
        es = 10.0 - self.current_epoch if self.global_rank == 0 else 5.0
        self.log("es_metric", es, sync_dist=False)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, _, idx = batch
        return idx, self(x)


class FrozenFirstLayerNet(Net):
    """``Net`` whose first layer starts frozen; :class:`UnfreezeFirstLayer` thaws it."""

    def __init__(self, optimizer: str = "sgd", lr: float = 0.1, init_seed: int = 0) -> None:
        super().__init__(optimizer, lr, init_seed)
        self.body[0].requires_grad_(False)


class UnfreezeFirstLayer(pl.Callback):
    """Unfreezes ``body[0]`` at the start of epoch ``epoch`` (like BackboneFinetuning)."""

    def __init__(self, epoch: int = 1) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            pl_module.body[0].requires_grad_(True)

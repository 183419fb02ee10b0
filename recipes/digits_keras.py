"""Digits (scikit-learn's 1,797 8x8 images, 10 classes) with Keras 3 on hvd_trainer.

Launch (from the repository root):
    2 processes, one node:   hvdrun -np 2 hvd-train recipe=digits_keras
    torch backend:           hvdrun -np 2 hvd-train recipe=digits_keras keras.backend=torch
    one process (CPU):       hvd-train recipe=digits_keras
    several nodes:           start hvd-train recipe=digits_keras on every node with torchrun's
                             rendezvous variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)

Each rank trains on an equal shard of a fixed, seeded train split; the learning rate ramps
from lr to lr * world_size over the first epochs (Goyal et al. 2017). Validation accuracy is
computed on the whole validation set (each rank scores its shard; counts are summed).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Config", "KerasConfig", "DataConfig", "OptimConfig", "run"]

BACKENDS = ("tensorflow", "torch")


class RecipeConfigError(ValueError):
    """A recipe setting out of range (the message echoes it and gives a HINT)."""


@dataclass(kw_only=True, slots=True)
class KerasConfig:
    backend: str = "tensorflow"
    """Keras backend, ``tensorflow`` or ``torch`` (set as KERAS_BACKEND before keras loads)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise RecipeConfigError(f"keras.backend={self.backend!r}; expected one of {BACKENDS}.")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    val_fraction: float = 0.2
    """Share of the 1,797 images held out for validation (stratified, seeded split)."""
    seed: int = 0
    """Seed of the train/validation split and of the weight initialisation."""

    def __post_init__(self) -> None:
        if not 0 < self.val_fraction < 1:
            raise RecipeConfigError(f"data.val_fraction={self.val_fraction!r} must be in (0, 1).")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 0.002
    """Adam learning rate for one process; the target after warmup is lr * world_size when
    ``scale_lr_by_world_size`` (printed on rank 0, never hidden)."""
    scale_lr_by_world_size: bool = True
    warmup_epochs: float = 2.0
    """Epochs of the linear ramp from lr to lr * world_size (0 = no warmup)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise RecipeConfigError(f"optim.lr={self.lr!r} must be > 0.")
        if self.warmup_epochs < 0:
            raise RecipeConfigError(f"optim.warmup_epochs={self.warmup_epochs!r} must be >= 0.")


@dataclass(kw_only=True, slots=True)
class Config:
    keras: KerasConfig = field(default_factory=KerasConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    epochs: int = 20
    batch_size: int = 32
    """Batch size per process; the global batch is batch_size * world_size."""
    hidden: int = 128
    """Width of the hidden layer of the MLP."""

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.hidden < 1:
            raise RecipeConfigError(
                f"epochs={self.epochs}, batch_size={self.batch_size}, hidden={self.hidden}: "
                "all must be >= 1."
            )


def _select_backend(backend: str) -> None:
    # Keras reads KERAS_BACKEND once, at import: set it first, and refuse a mismatch.
    if "keras" in sys.modules:
        import keras

        if keras.backend.backend() != backend:
            raise RecipeConfigError(
                f"keras is already imported with backend {keras.backend.backend()!r}, but "
                f"keras.backend={backend!r} was requested. HINT: run the recipe in a fresh process."
            )
    os.environ["KERAS_BACKEND"] = backend


def _load_digits(cfg: DataConfig, rank: int, size: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    x_tr, x_va, y_tr, y_va = train_test_split(
        x, y.astype("int64"), test_size=cfg.val_fraction, random_state=cfg.seed, stratify=y
    )
    # Equal train shards: every rank must run the same number of steps (each step is an
    # allreduce), so the remainder of len(train) / size is dropped.
    n = len(x_tr) // size * size
    val = slice(rank, None, size)  # evaluation has no collectives: shards may differ by one
    return (x_tr[rank:n:size], y_tr[rank:n:size]), (x_va[val], y_va[val]), n, len(y_va)


def run(cfg: Config) -> dict:
    _select_backend(cfg.keras.backend)
    import keras

    import hvd_trainer
    import hvd_trainer.keras as hvd_keras

    world = hvd_trainer.init()
    rank, size = world.rank, world.size
    (x_tr, y_tr), (x_va, y_va), n_train, n_val = _load_digits(cfg.data, rank, size)
    target_lr = cfg.optim.lr * size if cfg.optim.scale_lr_by_world_size else cfg.optim.lr
    if rank == 0:
        print(f"digits_keras: backend={keras.backend.backend()} world_size={size} "
              f"global_batch={cfg.batch_size * size} train={n_train} val={n_val} "
              f"lr={cfg.optim.lr} -> {target_lr} over {cfg.optim.warmup_epochs} warmup epochs",
              flush=True)

    keras.utils.set_random_seed(cfg.data.seed)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(cfg.hidden, activation="relu"),
        keras.layers.Dense(10),
    ])
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.Adam(target_lr))
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [
        hvd_keras.callbacks.BroadcastGlobalVariablesCallback(root_rank=0),
        hvd_keras.callbacks.MetricAverageCallback(),  # before anything that reads the logs
    ]
    if cfg.optim.warmup_epochs > 0:
        callbacks.append(hvd_keras.callbacks.LearningRateWarmupCallback(
            initial_lr=target_lr, warmup_epochs=cfg.optim.warmup_epochs))

    start = time.perf_counter()
    model.fit(x_tr, y_tr, batch_size=cfg.batch_size, epochs=cfg.epochs,
              validation_data=(x_va, y_va), callbacks=callbacks,
              verbose=2 if rank == 0 else 0)  # only rank 0 prints progress
    fit_s = time.perf_counter() - start

    logits = model.predict(x_va, batch_size=256, verbose=0)
    correct = float((np.argmax(logits, axis=1) == y_va).sum())
    import torch

    counts = hvd_trainer.allreduce(torch.tensor([correct, float(len(y_va))], dtype=torch.float64),
                                   op=hvd_trainer.Sum)
    return {
        "world_size": size,
        "val_acc": float(counts[0] / counts[1]),
        "epochs": cfg.epochs,
        "samples_per_s": n_train * cfg.epochs / fit_s,
        "wall_s": time.perf_counter() - start,
    }

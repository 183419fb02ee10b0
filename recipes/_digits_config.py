"""The digits recipe's config schema: what ``conf/digits.yaml`` and the command line can override,
with a docstring under each field and range checks in ``__post_init__``.

A module of its own, importing nothing but the standard library and ``recipes/_strategy.py``, so
that ``hvd-train recipe=digits`` reads, checks and prints the config (``--help``,
``--print-config``, a config error) without importing torch or Lightning; ``recipes/digits.py``
imports these classes and is the recipe that uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._strategy import check_slow_link_keys

__all__ = ["Config", "DataConfig", "ModelConfig", "OptimConfig", "TrainerConfig"]


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    max_epochs: int = 20
    """Passes over the training set."""
    strategy: str = "horovod"
    """Lightning strategy name; "horovod" averages gradients through hvd_trainer's comm layer."""
    accelerator: str = "auto"
    """"cpu", "gpu" or "auto"."""
    precision: str = "32-true"
    """Lightning precision flag, e.g. "32-true", "bf16-mixed", "16-mixed" (GPU)."""
    seed: int = 1234
    """Seed of model initialisation (rank 0's weights are broadcast) and data shuffling."""
    threads_per_process: int = 0
    """torch intra-op threads per process; 0 = CPU cores / processes on this node (at least 1)."""
    sync_every: int | str = 0
    """DiLoCo local steps: optimizer steps between two outer steps (each rank trains alone in
    between; no gradient allreduce). 0: synchronous data parallel (the default). "auto": chosen
    at the start of fit from the measured link and step (local steps, or a compression with
    trainer.compression=auto)."""
    outer_lr: float = 0.7
    """Outer SGD learning rate of local steps (DiLoCo: 0.7)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum of local steps (DiLoCo: 0.9)."""
    outer_overlap_steps: int = 0
    """Steps the outer gradient's allreduce may stay on the wire while training goes on (local
    steps; 0: blocking)."""
    outer_fragments: int = 1
    """Local steps: parts of the parameters with outer steps of their own, one part's every
    sync_every / outer_fragments steps (Streaming DiLoCo; 1: all at once)."""
    sync_warmup_steps: int = -1
    """Local steps: optimizer steps at the start each followed by an average of the parameters,
    before local steps begin (-1: the library's default, 128; 0: none)."""
    compression: str = "none"
    """Gradient wire format: "none", "fp16", "bf16", "int8", "powersgd:R" (error feedback), "auto"
    (from the measured link); with sync_every, of the outer gradient ("none", "bf16", "int8")."""

    def __post_init__(self) -> None:
        if self.max_epochs < 1:
            raise ValueError(f"trainer.max_epochs={self.max_epochs} must be >= 1.")
        if self.threads_per_process < 0:
            raise ValueError(f"trainer.threads_per_process={self.threads_per_process} must be >= 0.")
        check_slow_link_keys(self)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 0.05
    """SGD learning rate for the global batch (not scaled by world size)."""
    momentum: float = 0.9
    weight_decay: float = 1e-4

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr={self.lr} must be > 0.")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    batch_size_per_rank: int = 32
    """Images per rank per step; the global batch is this times the world size."""
    val_fraction: float = 0.2
    """Share of the 1,797 images held out for validation."""
    split_seed: int = 0
    """Seed of the train/val split, fixed so every run and every rank sees the same split."""

    def __post_init__(self) -> None:
        if self.batch_size_per_rank < 1:
            raise ValueError(f"data.batch_size_per_rank={self.batch_size_per_rank} must be >= 1.")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={self.val_fraction} must be in (0, 1).")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    channels: int = 32
    """Channels of the first conv layer (the second has twice as many)."""
    hidden: int = 128
    """Width of the fully connected layer."""
    dropout: float = 0.1


@dataclass(kw_only=True, slots=True)
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)

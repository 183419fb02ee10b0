"""The GPT recipe's config schema: what ``conf/gpt.yaml`` (``conf/gpt_gpu.yaml``) and the command
line can override, with a docstring under each field and range checks in ``__post_init__``.

A module of its own, importing nothing but the standard library and ``recipes/_strategy.py``, so
that ``hvd-train recipe=gpt`` reads, checks and prints the config (``--help``,
``--print-config``, a config error) without importing torch or Lightning; ``recipes/gpt.py``
imports these classes and is the recipe that uses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ._strategy import check_slow_link_keys

__all__ = ["Config", "DataConfig", "LogConfig", "ModelConfig", "OptimConfig", "SampleConfig", "TrainerConfig"]


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    max_steps: int = 500
    """Optimizer steps to train for (each is accumulate_grad_batches micro-batches per rank)."""
    accumulate_grad_batches: int = 1
    """Micro-batches per optimizer step; gradients are averaged across ranks once per step."""
    gradient_clip_val: float = 1.0
    """Clip the global gradient norm (of the rank-averaged gradient) to this; 0 disables."""
    val_every_n_steps: int = 0
    """Validate every this many optimizer steps during training (0: only at the end)."""
    log_every_n_steps: int = 25
    """Log train loss and learning rate (and print a progress line) every this many steps."""
    strategy: str = "horovod"
    """Lightning strategy name; "horovod" averages gradients through hvd_trainer's comm layer."""
    zero_stage: int = 0
    """ZeRO sharding with strategy "horovod" (README "ZeRO sharding"): 0 none, 1 optimizer state
    sharded over the ranks, 2 also the averaged gradients."""
    zero_overlap_exchange: bool = False
    """With zero_stage 1 or 2: the exchange of updated parameters overlaps the next forward
    (pays on a slow link; README "ZeRO sharding")."""
    accelerator: str = "auto"
    """"cpu", "gpu" or "auto"."""
    precision: str = "32-true"
    """Lightning precision flag: "32-true", "bf16-mixed" (GPU, or recent CPUs), "16-mixed" (GPU)."""
    seed: int = 1234
    """Seed of model initialisation (rank 0's weights are broadcast), shuffling and sampling."""
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
    progress_bar: str = "auto"
    """"tqdm" (Lightning's bar, rank 0), "lines" (a line per log_every_n_steps), "none", or "auto"
    (tqdm when stderr is a terminal, else lines: hvdrun forwards whole lines only)."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "accumulate_grad_batches", "log_every_n_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name}={getattr(self, name)} must be >= 1.")
        if self.val_every_n_steps < 0 or self.threads_per_process < 0 or self.gradient_clip_val < 0:
            raise ValueError("trainer.val_every_n_steps, threads_per_process and gradient_clip_val "
                             "must be >= 0.")
        check_slow_link_keys(self)
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2):
            raise ValueError(f"trainer.zero_stage={self.zero_stage!r} must be 0, 1 or 2.")
        if self.zero_stage and self.strategy != "horovod":
            raise ValueError(f"trainer.zero_stage={self.zero_stage} needs trainer.strategy=horovod "
                             f"(got trainer.strategy={self.strategy}).")
        if self.zero_overlap_exchange and not self.zero_stage:
            raise ValueError("trainer.zero_overlap_exchange=true needs trainer.zero_stage=1 or 2.")
        if self.progress_bar not in ("auto", "tqdm", "lines", "none"):
            raise ValueError(f"trainer.progress_bar={self.progress_bar!r}; expected auto, tqdm, lines "
                             "or none.")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    block_size: int = 128
    """Context length in bytes."""
    n_layer: int = 3
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block (n_embd must be a multiple)."""
    n_embd: int = 96
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout after embeddings, attention and MLP (0 for short runs)."""

    def __post_init__(self) -> None:
        if min(self.block_size, self.n_layer, self.n_head, self.n_embd) < 1:
            raise ValueError("model.block_size, n_layer, n_head and n_embd must be >= 1.")
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd={self.n_embd} must be a multiple of model.n_head={self.n_head}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1).")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 3e-3
    """Peak AdamW learning rate for the global batch (not scaled by world size)."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warmup from lr / warmup_steps to lr over this many optimizer steps."""
    weight_decay: float = 0.1
    """AdamW weight decay of matrices (embeddings included); biases and norms get none."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.99
    """AdamW's second-moment decay (0.99 rather than 0.999: small batches, short runs, as nanoGPT's
    Shakespeare config)."""

    def lr_factor(self, step: int, max_steps: int) -> float:
        """Multiplier of :attr:`lr` at optimizer step ``step`` (0-based): linear warmup over
        :attr:`warmup_steps` steps, then cosine decay to :attr:`min_lr` at ``max_steps`` (and
        :attr:`min_lr` after it)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, max_steps - self.warmup_steps))
        floor = self.min_lr / self.lr
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def __post_init__(self) -> None:
        if self.lr <= 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.lr={self.lr} must be > 0 and optim.min_lr={self.min_lr} in [0, lr].")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps} must be >= 0.")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    batch_size_per_rank: int = 16
    """Sequences per micro-batch on each rank; global batch = this x world size x accumulation."""
    val_fraction: float = 0.05
    """The last this fraction of every text is validation data (independent of world size)."""
    val_windows: int = 0
    """Validation sequences, spread evenly over the validation text (0: all of it, 1,975 at
    block_size=128). Each is evaluated once, on one rank, whatever the world size."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""

    def __post_init__(self) -> None:
        if self.batch_size_per_rank < 1 or self.val_windows < 0 or self.num_workers < 0:
            raise ValueError("data.batch_size_per_rank must be >= 1, val_windows and num_workers >= 0.")


@dataclass(kw_only=True, slots=True)
class SampleConfig:
    prompt: str = "ROMEO.\n"
    """Text the generated sample starts from."""
    new_tokens: int = 240
    """Bytes to generate at the end (0: no sample)."""
    temperature: float = 0.8
    """Softmax temperature of sampling."""
    top_k: int = 40
    """Sample among the k most likely bytes (0: all)."""


@dataclass(kw_only=True, slots=True)
class LogConfig:
    enabled: bool = True
    """Write logs (false: no files at all)."""
    root: str = "runs"
    """Rank 0 writes CSV and TensorBoard logs and config.yaml to <root>/<recipe>/<UTC time>/."""
    recipe: str = "gpt"
    """The <recipe> part of the log folder."""


@dataclass(kw_only=True, slots=True)
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    log: LogConfig = field(default_factory=LogConfig)

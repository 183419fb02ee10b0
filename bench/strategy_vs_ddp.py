"""Throughput of ``strategy="horovod"`` against Lightning's ``strategy="ddp"`` on CPU.

Same model (a small ResNet with GroupNorm: 42 parameter tensors of mixed sizes, so gradient
fusion matters), same synthetic data, seed and per-rank batch for both strategies. One 2-process
job (``hvdrun -np 2``, one thread per process) fits horovod, ddp, horovod, ddp, ... in the same
processes (both strategies adopt the one process group), so machine noise hits both alike; the
median of ``--repeats`` fits each is compared.
A 1-process run of the same model (single device, no communication) gives the scaling
efficiency, 2-process samples/s / (2 x 1-process samples/s) (weak scaling, as Horovod reports).

Run:
    python bench/strategy_vs_ddp.py                   # 3 fits each, ~3 minutes on 2 cores
    python bench/strategy_vs_ddp.py --repeats 5 --steps 60

Prints, last:
    RATIO horovod_vs_ddp_throughput=<x>
    RATIO scaling_efficiency_horovod=<x>
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hvd_trainer  # noqa: F401  (registers "horovod")

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"BENCH strategy=(\w+) samples_per_s=([0-9.]+) cpu_ms_per_step=([0-9.]+)")


# ------------------------------------------------------------------------------------------------
# worker: one training job, run by every rank
class Block(nn.Module):
    """Basic residual block: conv3x3-GN-ReLU-conv3x3-GN + (1x1 conv) skip."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(8, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(8, c_out)
        self.skip = (
            nn.Identity() if stride == 1 and c_in == c_out
            else nn.Conv2d(c_in, c_out, 1, stride, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(y)) + self.skip(x))


class ResNet(pl.LightningModule):
    """Three stages of two blocks (width w, 2w, 4w) on 3x32x32 inputs, 10 classes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        w = width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.GroupNorm(8, w), nn.ReLU())
        self.blocks = nn.Sequential(
            Block(w, w, 1), Block(w, w, 1), Block(w, 2 * w, 2), Block(2 * w, 2 * w, 1),
            Block(2 * w, 4 * w, 2), Block(4 * w, 4 * w, 1),
        )
        self.head = nn.Linear(4 * w, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Timer(pl.Callback):
    """Global samples and seconds from the start of batch ``warmup`` to the last batch's end."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = 0.0
        self.cpu_start = 0.0
        self.samples = 0
        self.steps = 0

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, i: int) -> None:
        if i == self.warmup:
            self.start = time.perf_counter()
            self.cpu_start = time.process_time()

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, out: Any, batch: Any, i: int) -> None:
        if i >= self.warmup:
            self.samples += batch[0].shape[0] * trainer.world_size
            self.steps += 1


def _fit_once(strategy: str, steps: int, warmup: int, batch: int, width: int) -> tuple[float, float]:
    """One fit from the same seed; returns (global training samples/s, this process's CPU
    milliseconds per step), both after ``warmup`` steps. CPU time is far less sensitive than
    wall time to other jobs sharing the machine."""
    pl.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    g = torch.Generator().manual_seed(0)
    n = batch * world * (steps + warmup)
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    timer = Timer(warmup)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=steps + warmup,
        callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(ResNet(width), DataLoader(data, batch_size=batch))
    cpu_ms = 1000 * (time.process_time() - timer.cpu_start) / max(timer.steps, 1)
    return timer.samples / (time.perf_counter() - timer.start), cpu_ms


def _worker(strategies: list[str], rounds: int, steps: int, warmup: int, batch: int, width: int) -> None:
    """Fit each strategy in turn, ``rounds`` times, in these same processes (one process group:
    both strategies adopt it), so machine noise hits both strategies alike."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for r in range(rounds):
        for strategy in strategies if r % 2 == 0 else strategies[::-1]:  # neither always first
            value, cpu_ms = _fit_once(strategy, steps, warmup, batch, width)
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"BENCH strategy={strategy} samples_per_s={value:.2f} cpu_ms_per_step={cpu_ms:.1f}",
                      flush=True)


# ------------------------------------------------------------------------------------------------
# driver: alternate the strategies, take medians
def _measure(
    strategies: list[str], procs: int, args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Run one job; return samples/s and rank-0 CPU ms/step per strategy, in run order."""
    hvdrun = str(Path(sys.executable).parent / "hvdrun")
    cmd = [hvdrun, "-np", str(procs), sys.executable, __file__, "--worker", ",".join(strategies),
           "--repeats", str(args.repeats), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch", str(args.batch), "--width", str(args.width)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    found: dict[str, list[float]] = {s: [] for s in strategies}
    cpu: dict[str, list[float]] = {s: [] for s in strategies}
    for name, value, cpu_ms in LINE.findall(proc.stdout):
        found[name].append(float(value))
        cpu[name].append(float(cpu_ms))
        print(f"  {name:8s} np={procs}  {float(value):9.1f} samples/s  {float(cpu_ms):7.1f} CPU ms/step",
              flush=True)
    if proc.returncode != 0 or any(len(v) != args.repeats for v in found.values()):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise SystemExit(f"benchmark run failed: {' '.join(cmd)}\n{tail}")
    return found, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--worker", metavar="STRATEGY", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help="runs per strategy (median)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per run")
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--width", type=int, default=16, help="channels of the first stage")
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker.split(","), args.repeats, args.steps, args.warmup, args.batch, args.width)
        return
    runs, cpu = _measure(["horovod", "ddp"], 2, args)
    runs["single"] = _measure(["auto"], 1, args)[0]["auto"]
    med = {k: statistics.median(v) for k, v in runs.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"median rank-0 CPU ms/step: horovod={cpu_med['horovod']:.1f} ddp={cpu_med['ddp']:.1f}")
    print(f"median samples/s: horovod={med['horovod']:.1f} ddp={med['ddp']:.1f} "
          f"1-process={med['single']:.1f} (per-rank batch {args.batch}, {args.repeats} runs each)")
    print(f"RATIO horovod_vs_ddp_throughput={med['horovod'] / med['ddp']:.3f}")
    print(f"RATIO scaling_efficiency_horovod={med['horovod'] / (2 * med['single']):.3f}")
    print(f"RATIO scaling_efficiency_ddp={med['ddp'] / (2 * med['single']):.3f}")
    print(f"RATIO horovod_vs_ddp_cpu_per_step={cpu_med['horovod'] / cpu_med['ddp']:.3f}")


if __name__ == "__main__":
    main()

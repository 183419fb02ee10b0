"""What an elastic commit costs the training loop, against a plain in-memory deep copy.

Horovod's elastic examples commit every batch and Horovod keeps the commit in memory only; a
commit here also reaches a file (so a restarted process can resume), but on a background
thread. This bench measures what the *caller* waits for.

Run (one process; no torchvision needed, the model is ResNet-18's layers built from torch.nn):

    PYTHONPATH=. python bench/elastic_commit.py              # torch State and the Lightning fit
    PYTHONPATH=. python bench/elastic_commit.py --reps 9 --skip-lightning

Per repetition, interleaved so machine noise hits both alike:

(a) ``commit``: ``TorchState(model, optimizer, epoch=..., batch=...).commit()`` with a file
    attached (the background write of the previous commit may still be running, as it would
    when committing every batch);
(b) ``copy``: ``copy.deepcopy`` of the same model and optimizer state dicts and values.

Then the same for the Lightning elastic fit: a ``Trainer(strategy=HorovodStrategy(...))`` fit of
the same model committing every optimizer step (``elastic_commit_every_n_steps=1``), timing each
``ElasticFit.commit`` against a deep copy of the model and optimizer state taken at that step.

Prints ``RATIO commit_vs_inmemory_copy=<x>`` (median commit / median copy; goal <= 2),
``RATIO lightning_commit_vs_inmemory_copy=<y>``, the medians in ms and the background writes done.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import hvd_trainer  # noqa: F401
except ImportError:  # run from elsewhere
    sys.path.insert(0, ".")


class _Block(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with batch norm and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


def resnet18_sized() -> nn.Module:
    """ResNet-18's layers (11.7 M parameters, 1000 classes) without torchvision."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000)]
    return nn.Sequential(*layers)


def _stepped(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum after one step, so its state holds a buffer per parameter."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    opt.step()
    return opt


def _ms(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def bench_state(reps: int, directory: Path) -> tuple[float, float, int]:
    """Median ms of ``TorchState.commit()`` and of a deep copy; background writes done."""
    from hvd_trainer.elastic import TorchState

    model = resnet18_sized()
    opt = _stepped(model)
    state = TorchState(model, opt, epoch=0, batch=0)
    state.attach_file(directory / "elastic_state.pt", writer=True)
    state.commit()  # warm-up
    state.flush()
    commits, copies = [], []
    for rep in range(reps):
        state.batch = rep
        commits.append(_ms(state.commit))
        copies.append(_ms(lambda rep=rep: copy.deepcopy(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 0, "batch": rep})))
    state.flush()
    return statistics.median(commits), statistics.median(copies), state._persist.writes


def bench_lightning(reps: int, directory: Path) -> tuple[float, float]:
    """Median ms of ``ElasticFit.commit`` in a fit committing every step, and of a deep copy."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    import hvd_trainer.lightning.elastic as lightning_elastic
    from hvd_trainer.strategy import HorovodStrategy

    commits: list[float] = []
    copies: list[float] = []
    original = lightning_elastic.ElasticFit.commit

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = resnet18_sized()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def timed(self: Any, trainer: pl.Trainer) -> None:
        opt = trainer.optimizers[0]
        module = trainer.lightning_module
        commits.append(_ms(lambda: original(self, trainer)))
        copies.append(_ms(lambda: copy.deepcopy(
            {"model": module.state_dict(), "optimizer": opt.state_dict(), "step": trainer.global_step})))

    os.environ.update({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "0",
                       "TORCHELASTIC_RUN_ID": "bench-elastic-commit"})
    lightning_elastic.ElasticFit.commit = timed  # type: ignore[method-assign]
    try:
        n = 2 * (reps + 1)
        data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 1000, (n,)))
        trainer = pl.Trainer(
            strategy=HorovodStrategy(elastic_checkpoint_dir=directory, elastic_commit_every_n_steps=1),
            accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(Net(), DataLoader(data, batch_size=2))
    finally:
        lightning_elastic.ElasticFit.commit = original  # type: ignore[method-assign]
    commits, copies = commits[1:], copies[1:]  # the first commit also warms the allocator
    return statistics.median(commits), statistics.median(copies)


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions (>= 5)")
    parser.add_argument("--skip-lightning", action="store_true")
    args = parser.parse_args()
    if args.reps < 5:
        parser.error("--reps must be at least 5")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory() as tmp:
        commit_ms, copy_ms, writes = bench_state(args.reps, Path(tmp))
        print(f"STATE commit_ms={commit_ms:.1f} copy_ms={copy_ms:.1f} background_writes={writes}")
        print(f"RATIO commit_vs_inmemory_copy={commit_ms / copy_ms:.2f}")
        if not args.skip_lightning:
            commit_ms, copy_ms = bench_lightning(args.reps, Path(tmp) / "lightning")
            print(f"LIGHTNING commit_ms={commit_ms:.1f} copy_ms={copy_ms:.1f}")
            print(f"RATIO lightning_commit_vs_inmemory_copy={commit_ms / copy_ms:.2f}")


if __name__ == "__main__":
    main()

"""``compression="auto"`` (torch ``DistributedOptimizer``) and ``sync_every="auto"``
(``hvd.LocalSGD``) over whatever link the hosts have: 9 steps each of a 4-layer MLP (66,048
parameters, 258 KiB of fp32 gradients; a batch of 4,096 rows makes a step compute ~30 ms on one
idle core). Rank 0 prints the library's announcement lines; every rank prints
``AUTO <rank> {phase, compression, sync_every, equal}`` (``equal``: the parameters after the
last step equal rank 0's).

``--phases N --sync-dir D``: N rounds in one job, so the test can reshape the link between them
without a new launch: round ``i`` starts when ``D/go<i>`` exists and ends with every rank's
``D/done<i>.<rank>``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hvd_trainer.torch as hvd

STEPS, WIDTH, LAYERS, BATCH = 9, 128, 4, 4096


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _train(opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(hvd.rank())
    for _ in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _equal(model: torch.nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return bool(torch.equal(hvd.broadcast(flat.clone(), root_rank=0), flat))


def _round(phase: int) -> None:
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression="auto")
    _train(opt, model)
    compression, equal = opt.compression.name, _equal(model)
    model = _model()
    local = hvd.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.01), model, sync_every="auto")
    _train(local, model)
    local.settle()
    equal = equal and _equal(model)
    record = {"phase": phase, "compression": compression, "sync_every": local.sync_every, "equal": equal}
    print(f"AUTO {hvd.rank()} {json.dumps(record)}", flush=True)


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--phases", type=int, default=1)
    p.add_argument("--sync-dir", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    for phase in range(args.phases):
        if args.sync_dir is not None:
            _wait_for(args.sync_dir / f"go{phase}")
        _round(phase)
        hvd.barrier()
        if args.sync_dir is not None:
            (args.sync_dir / f"done{phase}.{hvd.rank()}").touch()
    hvd.shutdown()


if __name__ == "__main__":
    main()

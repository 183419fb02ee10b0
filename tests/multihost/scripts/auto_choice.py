"""``compression="auto"`` (torch ``DistributedOptimizer``) and ``sync_every="auto"``
(``hvd.LocalSGD``) over whatever link the hosts have: 9 steps each of a 4-layer MLP (66,048
parameters, 258 KiB of fp32 gradients; a batch of 4,096 rows makes a step compute ~30 ms on one
idle core). Rank 0 prints the library's announcement lines; every rank prints
``AUTO <rank> {phase, compression, sync_every, equal}`` (``equal``: the parameters after the
last step equal rank 0's).

``--phases N --sync-dir D``: N rounds in one job, so the test can reshape the link between them
without a new launch: round ``i > 0`` starts when the test opens the named pipe ``D/go<i>`` for
writing and closes it (rank 0 blocks reading it; the others wait in a barrier).
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--phases", type=int, default=1)
    p.add_argument("--sync-dir", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    for phase in range(args.phases):
        if phase and args.sync_dir is not None:
            if hvd.rank() == 0:
                with open(args.sync_dir / f"go{phase}") as go:  # blocks until the test opens it
                    go.read()  # EOF when the test closes it: the link is reshaped
            hvd.barrier()
        _round(phase)
    hvd.shutdown()


if __name__ == "__main__":
    main()

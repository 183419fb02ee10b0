"""``compression="auto"`` (torch ``DistributedOptimizer``) and ``sync_every="auto"``
(``hvd.LocalSGD``) over whatever link the hosts have: 9 steps each of a 4-layer MLP (66,048
parameters, 258 KiB of fp32 gradients; a batch of 4,096 rows makes a step compute ~30 ms on one
core). Rank 0 prints the library's announcement lines; every rank prints
``AUTO <rank> {compression, sync_every, equal}`` (``equal``: the parameters after the last step
equal rank 0's).
"""

from __future__ import annotations

import json

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


def main() -> None:
    torch.set_num_threads(1)
    hvd.init()
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
    record = {"compression": compression, "sync_every": local.sync_every, "equal": equal}
    print(f"AUTO {hvd.rank()} {json.dumps(record)}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()

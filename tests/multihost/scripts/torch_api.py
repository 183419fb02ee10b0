"""The torch API across hosts: allreduce values, DistributedOptimizer == one process on the global batch.

Each rank prints ``ALLREDUCE <rank> <host> <json>`` and ``WEIGHTS <rank> <json>``; rank 0 also
prints ``REFERENCE <json>``: the same model trained by plain torch in one process on the global
batches (every rank's shard of a step together), which the averaged gradients must reproduce.
Then the same with Adam and ZeRO stage 2 (optimizer state and averaged gradients sharded over the
ranks of both hosts): ``ZERO <rank> <json>`` against rank 0's ``REFERENCE_ADAM <json>``.
"""

from __future__ import annotations

import json
import socket

import torch

import hvd_trainer.torch as hvd

BATCH, STEPS, LR = 3, 4, 0.2


def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _data(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    rows = STEPS * BATCH * size
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)


def _flat(model: torch.nn.Module) -> list[float]:
    return [round(float(v), 6) for v in torch.cat([p.detach().flatten() for p in model.parameters()])]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    t = torch.arange(3, dtype=torch.float64) + rank
    out = {"sum": hvd.allreduce(t, op=hvd.Sum).tolist(), "avg": hvd.allreduce(t).tolist(),
           "max": hvd.allreduce(t, op=hvd.Max).tolist(),
           "gathered": hvd.allgather(torch.tensor([rank])).tolist(),
           "bcast": hvd.broadcast(torch.tensor([rank * 10.0]), root_rank=size - 1).tolist(),
           "local": [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]}
    print(f"ALLREDUCE {rank} {socket.gethostname()} {json.dumps(out)}", flush=True)

    x, y = _data(size)
    g = BATCH * size  # step k uses rows [k*g, (k+1)*g); rank r takes its BATCH of them
    rows = [slice(k * g + rank * BATCH, k * g + (rank + 1) * BATCH) for k in range(STEPS)]
    mine = [(x[r], y[r]) for r in rows]
    model = _model()
    if rank > 0:  # a different start: the broadcast must make the ranks equal
        torch.nn.init.normal_(model[0].weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    _train(model, opt, mine)
    print(f"WEIGHTS {rank} {json.dumps(_flat(model))}", flush=True)
    zero = _model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(zero.parameters(), lr=0.05),
                                   named_parameters=zero.named_parameters(), zero_stage=2)
    _train(zero, opt, mine)
    print(f"ZERO {rank} {json.dumps(_flat(zero))}", flush=True)
    if rank == 0:
        global_batches = [(x[k * g:(k + 1) * g], y[k * g:(k + 1) * g]) for k in range(STEPS)]
        ref = _model()
        _train(ref, torch.optim.SGD(ref.parameters(), lr=LR), global_batches)
        print(f"REFERENCE {json.dumps(_flat(ref))}", flush=True)
        ref = _model()
        _train(ref, torch.optim.Adam(ref.parameters(), lr=0.05), global_batches)
        print(f"REFERENCE_ADAM {json.dumps(_flat(ref))}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()

"""Hierarchical allreduce across hosts: the fused reducer with ``hierarchical=True`` gives the
closed-form average (also for a bucket whose length is not a multiple of the local size), equal
to the flat reducer's; ``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` turns it on through the default
config. Prints ``HIER <rank> <json>``."""

from __future__ import annotations

import json

import torch

import hvd_trainer.torch as hvd
from hvd_trainer.comm import FusionConfig, GradientReducer
from hvd_trainer.comm.reduce.hierarchical import build_topology, hierarchical_allreduce_


def _grads(hierarchical: bool | None, rank: int) -> tuple[list[list[float]], bool]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))  # 26 values: 26 % 4 != 0
    cfg = FusionConfig(fusion_threshold_bytes=64, first_bucket_bytes=64, hierarchical=hierarchical)
    reducer = GradientReducer(model.named_parameters(), world=hvd.get_world(), config=cfg)
    x = torch.arange(6.0).reshape(2, 3) * (rank + 1)
    model(x).sum().backward()
    reducer.wait()
    out = [p.grad.flatten().tolist() for p in model.parameters()], reducer.hierarchy is not None
    reducer.remove()
    return out


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    world = hvd.get_world()
    hier, used = _grads(True, rank)
    flat, flat_used = _grads(False, rank)
    # Sum of ranks' vectors, 7 elements (padding inside the host), through the bare function.
    topo = build_topology(world, world.runtime.global_set)
    t = torch.arange(7.0) * (rank + 1)
    hierarchical_allreduce_(t, torch.distributed.ReduceOp.SUM, topo)
    print(f"HIER {rank} " + json.dumps({
        "hier": hier, "flat": flat, "used": used, "flat_used": flat_used,
        "sum7": t.tolist(), "expected7": (torch.arange(7.0) * size * (size + 1) / 2).tolist(),
        "hosts": topo.hosts, "local_size": topo.local_size,
    }), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()

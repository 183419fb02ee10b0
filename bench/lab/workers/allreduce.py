"""Bare allreduce on the lab: ``hvd.allreduce`` vs ``torch.distributed.all_reduce``, same tensors.

``--sizes 65536:20,1048576:5`` gives each message size in bytes (float32) and how many timed
calls it gets; for every size and round the modes run back to back (after one warm-up call
each), between barriers, and every rank prints one ``LAB`` record per (size, mode, round).
Modes: ``hvd`` (flat), ``torch``, and with several processes per host ``hier`` (the
hierarchical allreduce of :mod:`hvd_trainer.comm.reduce.hierarchical`).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from bench.lab.workers.common import Window, emit


def _time(mode: str, t: torch.Tensor, iters: int, round_: int, topo: object) -> None:
    import hvd_trainer as hvd
    from hvd_trainer.comm.reduce.hierarchical import hierarchical_allreduce_

    def once() -> None:
        if mode == "hvd":
            hvd.allreduce_(t, op=hvd.Sum, name=f"lab.{t.numel()}")
        elif mode == "hier":
            hierarchical_allreduce_(t, dist.ReduceOp.SUM, topo)
        else:
            dist.all_reduce(t)

    once()
    hvd.barrier()
    window = Window()
    window.start()
    for _ in range(iters):
        once()
    hvd.barrier()
    emit(workload="allreduce", mode=mode, round=round_, steps=iters, size_bytes=t.numel() * 4,
         world=hvd.size(), **window.stop())


def main() -> None:
    import hvd_trainer as hvd

    p = argparse.ArgumentParser()
    p.add_argument("--sizes", required=True, help="bytes:iters,... (float32 messages)")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    from hvd_trainer.comm.reduce.hierarchical import build_topology

    world = hvd.get_world()
    topo = build_topology(world, world.runtime.global_set)
    modes = ("hvd", "torch") if topo is None else ("hvd", "hier", "torch")
    plan = [tuple(int(v) for v in item.split(":")) for item in args.sizes.split(",")]
    for r in range(args.rounds):
        for size, iters in plan:
            t = torch.ones(size // 4)
            for mode in modes:
                _time(mode, t, iters, r, topo)


if __name__ == "__main__":
    main()

"""Throughput of hvd_trainer.DistributedOptimizer vs torch DDP on CPU (gloo), same model/data.

Run:  PYTHONPATH=. python bench/optimizer_vs_ddp.py [--np 2] [--steps 40] [--reps 3]

Both modes run in the same 2 processes (one thread each), alternating, ``--reps`` times; the
median samples/s of each is compared:
    RATIO hvd_optimizer_vs_ddp_throughput=<hvd / ddp>
The model has many parameter tensors of mixed sizes (Linear + LayerNorm blocks), so bucketing
matters. Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.multiprocessing as mp

WIDTH, DEPTH, BATCH = 256, 12, 64


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


def _train(mode: str, steps: int) -> float:
    """Samples per second (global) of ``steps`` timed steps after 5 warm-up steps."""
    import hvd_trainer as hvd

    model = _model()
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        net = model
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), model.named_parameters()
        )
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
    for i in range(steps + 5):
        if i == 5:
            hvd.barrier()
            start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    hvd.barrier()
    return steps * BATCH * hvd.size() / (time.perf_counter() - start)


def _worker(rank: int, size: int, port: int, steps: int, reps: int, q) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import hvd_trainer as hvd

    hvd.init(backend="gloo")
    rates: dict[str, list[float]] = {"hvd": [], "ddp": []}
    for _ in range(reps):
        for mode in ("hvd", "ddp"):
            rates[mode].append(_train(mode, steps))
    if rank == 0:
        q.put(rates)
    hvd.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    from hvd_trainer.comm import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.np, port, args.steps, args.reps, q))
             for r in range(args.np)]
    for p in procs:
        p.start()
    rates = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    hvd_rate, ddp_rate = statistics.median(rates["hvd"]), statistics.median(rates["ddp"])
    print(f"samples/s hvd={[round(r) for r in rates['hvd']]} ddp={[round(r) for r in rates['ddp']]}")
    print(f"RATIO hvd_optimizer_vs_ddp_throughput={hvd_rate / ddp_rate:.3f}")


if __name__ == "__main__":
    main()

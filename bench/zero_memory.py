"""ZeRO memory and step time: optimizer-state bytes per rank and step time for zero_stage
0/1/2 of hvd_trainer.DistributedOptimizer, and torch DDP, on CPU (gloo, loopback).

Run:  PYTHONPATH=. python bench/zero_memory.py [--np 2 3] [--width 1024] [--depth 8]
                                              [--steps 20] [--rounds 3]

Prints, per world size N:
  * exact optimizer-state bytes per rank (sum of numel * element_size over every tensor in the
    inner optimizer's state; AdamW fp32) for stage 0, 1, 2 and the unsharded total, and
    ``RATIO zero1_state_bytes_vs_unsharded=<max over ranks of stage-1 bytes / unsharded bytes>``
    (ideal 1/N), the same for stage 2, and stage 2's gradient bytes held after synchronize()
    (the gradients of what the optimizer's ``param_groups`` hold then);
  * step time (median ms of ``--steps`` timed steps after 3 warm-up steps) of stage 0/1/2 and
    DDP, the modes interleaved over ``--rounds`` rounds (a machine-load drift hits all modes
    alike), with ``RATIO zero<k>_step_time_vs_<stage0|ddp>=...``, and the 1-minute load average
    before and after (figures from a loaded machine are not comparable).
Not a test: the byte counts are exact, the times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.multiprocessing as mp

BATCH = 32
MODES = ("stage0", "stage1", "stage2", "ddp")


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def _make(mode: str, width: int, depth: int):
    import hvd_trainer as hvd

    model = _model(width, depth)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if mode == "ddp":
        return model, torch.nn.parallel.DistributedDataParallel(model), inner
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                   zero_stage=int(mode[-1]))
    return model, model, opt


def _memory(mode: str, width: int, depth: int) -> dict[str, int]:
    """Exact state and gradient bytes on this rank after two steps."""
    from hvd_trainer.comm.zero import state_bytes

    _, net, opt = _make(mode, width, depth)
    x, y = torch.randn(BATCH, width), torch.randint(0, 10, (BATCH,))
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.synchronize()
        # what the optimizer reads: its param_groups (stage 2 by elements: the owned pieces
        # stand there for a parameter cut between ranks, whose own .grad is None)
        grads = sum(q.grad.numel() * q.grad.element_size() for g in opt.param_groups
                    for q in g["params"] if q.grad is not None)
        with opt.skip_synchronize():
            opt.step()
    return {"state": state_bytes(opt.optimizer), "grads": grads}


def _time(mode: str, width: int, depth: int, steps: int) -> float:
    """Median step time (ms) of ``steps`` timed steps after 3 warm-up steps."""
    import hvd_trainer as hvd

    _, net, opt = _make(mode, width, depth)
    x, y = torch.randn(BATCH, width), torch.randint(0, 10, (BATCH,))
    times = []
    for i in range(steps + 3):
        hvd.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _worker(rank: int, size: int, port: int, args: argparse.Namespace, q) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import hvd_trainer as hvd

    hvd.init(backend="gloo")
    memory = {m: _memory(m, args.width, args.depth) for m in ("stage0", "stage1", "stage2")}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            times[mode].append(_time(mode, args.width, args.depth, args.steps))
    q.put((rank, memory, times))
    hvd.shutdown()


def _run(size: int, args: argparse.Namespace) -> None:
    from hvd_trainer.comm import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, size, port, args, q)) for r in range(size)]
    load_before = os.getloadavg()[0]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    load_after = os.getloadavg()[0]
    params = sum(p.numel() for p in _model(args.width, args.depth).parameters())
    unsharded = results[0][1]["stage0"]["state"]
    print(f"N={size} parameters={params} AdamW fp32; load average (1 min) before={load_before:.2f} "
          f"after={load_after:.2f}")
    for mode in ("stage0", "stage1", "stage2"):
        per_rank = [r[1][mode]["state"] for r in results]
        grads = [r[1][mode]["grads"] for r in results]
        print(f"  {mode}: optimizer-state bytes per rank {per_rank}; grad bytes after "
              f"synchronize {grads}")
    for stage in (1, 2):
        worst = max(r[1][f"stage{stage}"]["state"] for r in results)
        print(f"RATIO zero{stage}_state_bytes_vs_unsharded={worst / unsharded:.4f} (N={size}, "
              f"ideal {1 / size:.4f})")
    worst_grads = max(r[1]["stage2"]["grads"] for r in results)
    print(f"RATIO zero2_grad_bytes_vs_unsharded={worst_grads / results[0][1]['stage0']['grads']:.4f} "
          f"(N={size})")
    med = {m: statistics.median(t for r in results for t in r[2][m]) for m in MODES}
    print("  step ms (median over ranks and rounds): "
          + " ".join(f"{m}={med[m]:.2f}" for m in MODES))
    for stage in (1, 2):
        for base in ("stage0", "ddp"):
            print(f"RATIO zero{stage}_step_time_vs_{base}={med[f'stage{stage}'] / med[base]:.3f} (N={size})")


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--np", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for size in args.np:
        _run(size, args)


if __name__ == "__main__":
    main()

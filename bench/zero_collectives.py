"""ZeRO's collectives on CPU: gloo's own reduce-scatter / allgather against the point-to-point
versions hvd_trainer uses (``hvd_trainer.comm.zero.collectives``), and the allreduce they stand
in for. Time and bytes actually sent.

Run:  PYTHONPATH=. python bench/zero_collectives.py [--np 2] [--mb 33.6] [--rounds 10]

One bucket of ``--mb`` MB of fp32, split into ``--np`` equal parameters (one per rank, so the
shard plan is balanced). Per operation: the median time (ms) over ``--rounds`` interleaved rounds
after 3 warm-up rounds, and the bytes the ``lo`` interface received during it, as a multiple of
the bucket (``/proc/net/dev``; every byte a rank sends on loopback is counted once; other traffic
on ``lo`` during the run inflates it, so run it on an otherwise idle machine). Ideal for
``N`` ranks: allreduce ``2(N-1)`` buckets in all, reduce-scatter and allgather ``N-1``.

Prints ``RATIO direct_reducescatter_vs_gloo_time=...`` and ``..._vs_allreduce_time``,
``RATIO broadcast_exchange_vs_gloo_allgather_time=...``, and the byte multiples, with the
1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.multiprocessing as mp

OPS = ("allreduce", "gloo_reducescatter", "direct_reducescatter", "gloo_allgather",
       "broadcast_exchange")


def _lo_rx_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    raise RuntimeError("no lo interface in /proc/net/dev")


def _worker(rank: int, size: int, port: int, args: argparse.Namespace, q) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    import hvd_trainer as hvd
    from hvd_trainer.comm.ops.checks import Signature
    from hvd_trainer.comm.ops.process_set import resolve_set
    from hvd_trainer.comm.zero.collectives import exchange_parameters, start_reducescatter
    from hvd_trainer.comm.zero.plan import plan_shards

    hvd.init(backend="gloo")
    numel = int(args.mb * 1e6 / 4) // size
    plan = plan_shards([list(range(size))], [numel] * size, [4] * size, size)
    shard = plan.buckets[0]
    params = [torch.randn(numel) for _ in range(size)]
    pset = resolve_set(None, hvd.get_world(), "bench")
    flat = torch.randn(shard.buffer_numel)
    seg = torch.empty(shard.chunk)
    total = numel * size
    sig = Signature("reducescatter", "bench.bucket", (("numel", flat.numel()),))

    def run(op: str) -> None:
        if op == "allreduce":
            dist.all_reduce(flat)
        elif op == "gloo_reducescatter":
            dist.reduce_scatter_single(seg, flat)
        elif op == "direct_reducescatter":
            start_reducescatter(flat, shard, pset=pset, sig=sig).finish()
        elif op == "gloo_allgather":
            dist.all_gather_single(flat, seg)
        else:
            exchange_parameters([(shard, [params[i] for i in shard.params], "bench")], pset=pset)

    times: dict[str, list[float]] = {op: [] for op in OPS}
    sent: dict[str, list[float]] = {op: [] for op in OPS}
    for i in range(args.rounds + 3):
        for op in OPS:
            dist.barrier()
            before = _lo_rx_bytes()
            t0 = time.perf_counter()
            run(op)
            elapsed = time.perf_counter() - t0
            dist.barrier()
            if i >= 3:
                times[op].append(elapsed)
                sent[op].append((_lo_rx_bytes() - before) / (total * 4))
    q.put((rank, {op: statistics.median(v) * 1e3 for op, v in times.items()},
           {op: statistics.median(v) for op, v in sent.items()}))
    hvd.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--mb", type=float, default=33.6)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    from hvd_trainer.comm import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    load_before = os.getloadavg()[0]
    procs = [ctx.Process(target=_worker, args=(r, args.np, port, args, q)) for r in range(args.np)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    load_after = os.getloadavg()[0]
    ms = {op: max(r[1][op] for r in results) for op in OPS}  # the slowest rank sets the pace
    bytes_x = results[0][2]
    print(f"N={args.np} bucket={args.mb} MB fp32, loopback gloo; load average (1 min) "
          f"before={load_before:.2f} after={load_after:.2f}")
    for op in OPS:
        print(f"  {op:22s} {ms[op]:8.1f} ms  lo bytes {bytes_x[op]:.2f} x bucket")
    print(f"RATIO direct_reducescatter_vs_gloo_time="
          f"{ms['direct_reducescatter'] / ms['gloo_reducescatter']:.3f}")
    print(f"RATIO direct_reducescatter_vs_allreduce_time={ms['direct_reducescatter'] / ms['allreduce']:.3f}")
    print(f"RATIO broadcast_exchange_vs_gloo_allgather_time="
          f"{ms['broadcast_exchange'] / ms['gloo_allgather']:.3f}")
    print(f"RATIO direct_reducescatter_vs_allreduce_bytes="
          f"{bytes_x['direct_reducescatter'] / bytes_x['allreduce']:.3f}")
    print(f"RATIO gloo_reducescatter_vs_allreduce_bytes="
          f"{bytes_x['gloo_reducescatter'] / bytes_x['allreduce']:.3f}")


if __name__ == "__main__":
    main()

"""Allreduce throughput across a veth link between two network namespaces vs within one host.

Run as root (it makes two namespace "hosts" joined by a switch namespace, as tests/multihost do):

    PYTHONPATH=. .venv/bin/python bench/multihost_allreduce.py              # 16 MiB x 20, 2 ranks
    PYTHONPATH=. .venv/bin/python bench/multihost_allreduce.py --mib 64 --iters 10

Both runs have 2 ranks over gloo, started by hvdrun: ``-np 2`` on this host (loopback), and
``-np 2 -H h1:1,h2:1 --no-ssh`` run in the two namespaces (same-line mode). Rank 0 times
``--iters`` blocking ``allreduce(op=Sum)`` calls of a float32 tensor of ``--mib`` MiB after 3
warm-up calls and reports the algorithm bandwidth, tensor bytes per second
(``iters * bytes / seconds``; a 2-rank ring sends about that much each way).

Prints ``BW local bytes_per_s=...``, ``BW cross_host bytes_per_s=...`` and
``RATIO allreduce_cross_host_vs_local=<cross / local>``. The veth pair is in-kernel (no wire),
so the ratio shows what the namespace path (veth + bridge + separate TCP stacks) costs, not a
real network; on real hosts expect the link's bandwidth to dominate.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HVDRUN = [sys.executable, "-c", "import sys; from hvd_trainer.launch.cli import main; sys.exit(main())"]


def worker(mib: float, iters: int) -> None:
    """One rank: time ``iters`` allreduces of ``mib`` MiB (float32); rank 0 prints ``BW_RESULT``."""
    import torch

    import hvd_trainer.torch as hvd

    hvd.init()
    t = torch.ones(int(mib * 2**20 // 4), dtype=torch.float32)
    for _ in range(3):
        hvd.allreduce(t, op=hvd.Sum)
    hvd.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        out = hvd.allreduce(t, op=hvd.Sum)
    seconds = time.perf_counter() - start
    assert float(out[0]) == hvd.size()
    if hvd.rank() == 0:
        print(f"BW_RESULT {iters * t.numel() * 4 / seconds:.1f}", flush=True)
    hvd.shutdown()


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _bandwidth(outputs: list[str]) -> float:
    found = [float(m) for out in outputs for m in re.findall(r"BW_RESULT (\S+)", out)]
    if len(found) != 1:
        raise SystemExit("no result from rank 0:\n" + "\n".join(out[-3000:] for out in outputs))
    return found[0]


def run_local(args: argparse.Namespace) -> float:
    cmd = [*HVDRUN, "-np", "2", sys.executable, __file__, "--worker", "--mib", str(args.mib),
           "--iters", str(args.iters)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    return _bandwidth([proc.stdout + proc.stderr])


def run_cross_host(args: argparse.Namespace) -> float:
    from tests.multihost.netns import cluster, skip_reason

    reason = skip_reason()
    if reason is not None:
        raise SystemExit(f"cannot measure across namespaces: {reason}")
    with cluster(2) as c:
        cmd = [*HVDRUN, "-np", "2", "-H", "h1:1,h2:1", "--no-ssh", "--port", "29400", sys.executable,
               __file__, "--worker", "--mib", str(args.mib), "--iters", str(args.iters)]
        procs = [h.popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for h in c.hosts]
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    return _bandwidth(outputs)


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--mib", type=float, default=16.0, help="tensor size, MiB (float32)")
    p.add_argument("--iters", type=int, default=20, help="timed allreduces per run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.mib, args.iters)
        return
    local = run_local(args)
    print(f"BW local bytes_per_s={local:.0f} ({local / 2**20:.1f} MiB/s)", flush=True)
    cross = run_cross_host(args)
    print(f"BW cross_host bytes_per_s={cross:.0f} ({cross / 2**20:.1f} MiB/s)", flush=True)
    print(f"RATIO allreduce_cross_host_vs_local={cross / local:.3f}", flush=True)


if __name__ == "__main__":
    main()

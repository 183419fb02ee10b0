"""Step cost of the partition heartbeat (comm.world.heartbeat): 2 namespace hosts x 2 processes.

Run as root (network namespaces, as tests/multihost): ``.venv/bin/python bench/heartbeat_overhead.py``

Runs the same job (hvdrun's same-line mode on hosts h1 and h2 joined by a veth switch) with the
heartbeat off (``HOROVOD_GLOO_TIMEOUT_SECONDS=0``) and on (the default), alternating ``--rounds``
times. Each rank times ``--steps`` steps of one 1 MiB allreduce plus a small matmul; rank 0 prints
the median step time. Prints one ``STEP`` line per run and ``RATIO heartbeat_on_vs_off=<x>``
(medians over the rounds).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.multihost.netns import cluster, skip_reason  # noqa: E402

WORKER = r"""
import statistics, sys, time, torch
import hvd_trainer.torch as hvd
hvd.init()
grad, w = torch.ones(262144), torch.randn(256, 256)
times = []
for step in range(int(sys.argv[1])):
    t = time.perf_counter()
    hvd.allreduce(grad, name="g")
    (w @ w).sum()
    times.append(time.perf_counter() - t)
if hvd.rank() == 0:
    print(f"MEDIAN_MS {statistics.median(times[10:]) * 1e3:.3f}", flush=True)
"""


def _run(c, steps: int, timeout_env: str | None) -> float:
    hvdrun = os.path.join(os.path.dirname(sys.executable), "hvdrun")
    env = {k: v for k, v in os.environ.items() if k != "HOROVOD_GLOO_TIMEOUT_SECONDS"}
    env["HOROVOD_SECRET_KEY"] = "bench"
    if timeout_env is not None:
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = timeout_env
    line = [hvdrun, "-np", "4", "-H", "h1:2,h2:2", "--port", "29400", "--no-ssh", sys.executable,
            "-c", WORKER, str(steps)]
    procs = [h.popen(line, env=env, stdout=subprocess.PIPE, text=True) for h in c.hosts]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a run failed:\n{outs[0][-2000:]}\n{outs[1][-2000:]}")
    return float(re.search(r"MEDIAN_MS (\S+)", outs[0]).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    reason = skip_reason()
    if reason is not None:
        raise SystemExit(f"cannot run: {reason}")
    off, on = [], []
    with cluster(2) as c:
        for _ in range(args.rounds):
            off.append(_run(c, args.steps, "0"))
            print(f"STEP heartbeat=off median={off[-1]:.3f} ms", flush=True)
            on.append(_run(c, args.steps, None))
            print(f"STEP heartbeat=on median={on[-1]:.3f} ms", flush=True)
    print(f"RATIO heartbeat_on_vs_off={statistics.median(on) / statistics.median(off):.3f} "
          f"(median step {statistics.median(on):.3f} ms on, {statistics.median(off):.3f} ms off)")


if __name__ == "__main__":
    main()

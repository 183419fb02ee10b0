"""Scaling report of the GPT recipe: tokens/s and efficiency at 1, 2, ... N processes.

Runs ``hvdrun -np k hvd-train recipe=gpt`` for a fixed number of optimizer steps at each k
(validation, sampling and logs off), reads tokens_per_s from each RESULT line and writes
``scaling.csv`` and ``scaling.png`` (tokens/s against processes with the ideal line k x the
1-process rate, and the efficiency tokens_per_s(k) / (k x tokens_per_s(1))). The batch per rank
is fixed (weak scaling, as Horovod reports it) and every process gets ``--threads`` intra-op
threads (default 1, one core each), so k processes use k times the cores of one: on a machine
with fewer than k x threads free cores the efficiency measures the machine's load, not the
communication (the report prints the load average).

Run:
    python bench/scaling.py                          # 1 and 2 processes, 60 steps, ~2 minutes on 2 cores
    python bench/scaling.py --max-np 8 --steps 200   # a bigger machine
    python bench/scaling.py --max-np 8 -- trainer.accelerator=gpu trainer.precision=bf16-mixed

Prints, last (one line per k >= 2):
    RATIO scaling_efficiency_np2=<x>
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent
TOKENS = re.compile(r"RESULT world_size=(\d+) .* tokens_per_s=(\d+\.\d)")


@dataclass(frozen=True, slots=True)
class Point:
    """One process count: median training tokens/s of the whole job and the efficiency."""

    processes: int
    tokens_per_s: float
    efficiency: float
    runs: tuple[float, ...]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--max-np", type=int, default=2, help="largest process count (default 2)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default 60)")
    p.add_argument("--repeats", type=int, default=1, help="runs per process count; the median counts")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process (default 1)")
    p.add_argument("--recipe", default="gpt")
    p.add_argument("--out", type=Path, default=None, help="folder (default runs/scaling/<UTC time>)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run (after --)")
    ns = p.parse_args(argv)
    if ns.max_np < 2 or ns.steps < 5 or ns.repeats < 1:
        p.error("--max-np must be >= 2, --steps >= 5, --repeats >= 1")
    return ns


def run_once(ns: argparse.Namespace, processes: int) -> float:
    """tokens/s of one ``hvdrun -np processes`` run; raises RuntimeError with the output tail."""
    cmd = [str(BIN / "hvdrun"), "-np", str(processes), str(BIN / "hvd-train"), f"recipe={ns.recipe}",
           f"trainer.max_steps={ns.steps}", f"trainer.log_every_n_steps={ns.steps}",
           "trainer.val_every_n_steps=0", f"trainer.threads_per_process={ns.threads}",
           "trainer.progress_bar=none", "data.val_windows=16", "sample.new_tokens=0", "log.enabled=false",
           *ns.overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ns.timeout)
    match = next((m for m in map(TOKENS.search, proc.stdout.splitlines()) if m), None)
    if proc.returncode != 0 or match is None:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{tail}")
    return float(match[2])


def measure(ns: argparse.Namespace) -> list[Point]:
    rates: dict[int, list[float]] = {}
    for processes in range(1, ns.max_np + 1):
        rates[processes] = [run_once(ns, processes) for _ in range(ns.repeats)]
        print(f"np={processes} tokens_per_s={statistics.median(rates[processes]):.1f} "
              f"runs={rates[processes]}", flush=True)
    base = statistics.median(rates[1])
    medians = {k: statistics.median(v) for k, v in rates.items()}
    return [Point(k, medians[k], medians[k] / (k * base), tuple(rates[k])) for k in rates]


def write_csv(points: list[Point], path: Path) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["processes", "tokens_per_s", "ideal_tokens_per_s", "efficiency", "runs"])
        for p in points:
            ideal = p.processes * points[0].tokens_per_s
            w.writerow([p.processes, f"{p.tokens_per_s:.1f}", f"{ideal:.1f}", f"{p.efficiency:.4f}",
                        " ".join(f"{r:.1f}" for r in p.runs)])


def write_png(points: list[Point], path: Path, title: str) -> None:
    import matplotlib  # an extra (hvd_trainer[gpt]); imported here so --help works without it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [p.processes for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(ks, [p.tokens_per_s for p in points], "o-", label="measured")
    left.plot(ks, [k * points[0].tokens_per_s for k in ks], "--", color="grey", label="ideal (k x 1 process)")
    left.set(xlabel="processes", ylabel="training tokens / s", title="throughput", xticks=ks)
    left.legend()
    right.plot(ks, [p.efficiency for p in points], "o-")
    right.axhline(1.0, linestyle="--", color="grey", label="ideal")
    right.set(xlabel="processes", ylabel="tokens/s / (k x 1-process tokens/s)", title="scaling efficiency",
              xticks=ks, ylim=(0, 1.1))
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ns = _args(argv)
    out = ns.out or Path("runs") / "scaling" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    print(f"scaling: recipe={ns.recipe} steps={ns.steps} threads_per_process={ns.threads} "
          f"max_np={ns.max_np} cpus={os.cpu_count()} load_avg_1min={load:.2f} out={out}", flush=True)
    points = measure(ns)
    write_csv(points, out / "scaling.csv")
    title = (f"hvdrun -np k hvd-train recipe={ns.recipe}: {ns.steps} steps, {ns.threads} thread(s)/process, "
             f"load {load:.1f} on {os.cpu_count()} CPUs")
    write_png(points, out / "scaling.png", title)
    print(f"scaling: wrote {out / 'scaling.csv'} and {out / 'scaling.png'}")
    for p in points[1:]:
        print(f"RATIO scaling_efficiency_np{p.processes}={p.efficiency:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

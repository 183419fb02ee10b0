"""Start-up cost users feel: from the launch command to the end of the first optimizer step.

``hvdrun -np 2 python train.py`` with ``hvd_trainer`` (``hvd.init()``, ``DistributedOptimizer``,
``broadcast_parameters``) against ``torchrun --nproc-per-node 2 train.py`` with plain
``torch.distributed`` + ``DistributedDataParallel`` (gloo), the same model and first step. Each
worker writes the wall-clock time its first ``optimizer.step()`` returned; the launch-to-step time
is the latest rank's minus the time the launcher was started. Runs alternate, ``--repeats`` each.

Prints one ``SAMPLE`` line per run, the medians, and
``RATIO startup_hvdrun_vs_torchrun_ddp=<median hvdrun> / <median torchrun>`` (goal <= 1.10).

Run: ``python bench/startup.py [--repeats 5]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker(mode: str, out_dir: str) -> None:
    phases = {"entered": time.time()}
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    if mode == "hvd":
        import hvd_trainer as hvd

        phases["imported"] = time.time()
        hvd.init()
        phases["initialised"] = time.time()
        rank = hvd.rank()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        net = model
    else:
        import torch.distributed as dist

        phases["imported"] = time.time()
        dist.init_process_group("gloo")
        phases["initialised"] = time.time()
        rank = dist.get_rank()
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    phases["stepped"] = time.time()
    Path(out_dir, f"rank{rank}").write_text(json.dumps(phases))


def _launch(mode: str, exe_dir: Path) -> dict[str, float]:
    """Seconds from the launch to each phase (latest rank): entered (the script runs),
    imported, initialised (process group made), stepped (first optimizer step returned)."""
    with tempfile.TemporaryDirectory() as out:
        if mode == "hvd":
            cmd = [str(exe_dir / "hvdrun"), "-np", "2", sys.executable, __file__, "--worker", mode, out]
        else:
            cmd = [str(exe_dir / "torchrun"), "--standalone", "--nproc-per-node", "2",
                   __file__, "--worker", mode, out]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        start = time.time()
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        ranks = [json.loads(Path(out, f"rank{r}").read_text()) for r in range(2)]
        return {k: max(p[k] for p in ranks) - start for k in ranks[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "OUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(*args.worker)
        return
    exe_dir = Path(sys.executable).parent
    times: dict[str, list[float]] = {"hvd": [], "ddp": []}
    for i in range(args.repeats):
        for mode in ("hvd", "ddp"):
            phases = _launch(mode, exe_dir)
            times[mode].append(phases["stepped"])
            shown = " ".join(f"{k}={v:.2f}s" for k, v in phases.items())
            print(f"SAMPLE rep={i} {mode} {shown}", flush=True)
    hvd_s, ddp_s = statistics.median(times["hvd"]), statistics.median(times["ddp"])
    print(f"median launch_to_first_step_s: hvdrun+hvd_trainer={hvd_s:.2f} torchrun+DDP={ddp_s:.2f} "
          f"(load average {os.getloadavg()[0]:.2f})")
    print(f"RATIO startup_hvdrun_vs_torchrun_ddp={hvd_s / ddp_s:.3f}", flush=True)


if __name__ == "__main__":
    main()

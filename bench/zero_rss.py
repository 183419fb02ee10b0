"""Peak resident memory per process of the GPT recipe at a larger size: ZeRO stage 0/1/2 of
``strategy="horovod"`` against ``strategy="ddp"``, side by side in one run.

Run:  .venv/bin/python bench/zero_rss.py [--np 2] [--layers 8] [--width 512] [--steps 6]
                                         [--modes stage0,stage1,stage2,ddp]

Each mode runs ``hvdrun -np N /usr/bin/time -f 'MAXRSS %M' hvd-train recipe=gpt
model.n_layer=L model.n_embd=W ...`` (8 x 512: 25.3M parameters, AdamW fp32; 2 sequences of 128
bytes per rank and step, 4 validation windows, no sample) so GNU time reports each rank's peak
resident set (kilobytes, ``getrusage``'s ``ru_maxrss`` of the training process). Prints one
``RSS`` line per mode (MiB per rank), ``RATIO zero<k>_peak_rss_vs_<stage0|ddp>`` (worst rank),
and the Adam state the paper's formula predicts per rank: stage 0 16 bytes per parameter
(weights 4, gradients 4, moments 8), stage 1 (4 + 4 + 8/N), stage 2 (4 + (4 + 8)/N) after
backward (Rajbhandari et al. 2020, arXiv:1910.02054, section 5). The load average before and
after is printed: figures from a loaded machine are not comparable. Needs GNU time
(``/usr/bin/time``, Debian package ``time``).

Peak RSS also holds what every mode shares (the interpreter, torch, Lightning, the data and the
activations), so the ratio of peaks is smaller than the ratio of model states.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAXRSS = re.compile(r"^\[(\d+)\]<stderr>:MAXRSS (\d+)$", re.M)


def run_mode(mode: str, args: argparse.Namespace) -> list[float]:
    """Peak RSS per rank (MiB, rank order) of one run of ``mode``.

    Raises:
        RuntimeError: the run failed or a rank's MAXRSS line is missing (output tail included).
    """
    bindir = Path(sys.executable).parent
    strategy = ["trainer.strategy=ddp"] if mode == "ddp" else [f"trainer.zero_stage={mode[-1]}"]
    cmd = [str(bindir / "hvdrun"), "-np", str(args.np), "/usr/bin/time", "-f", "MAXRSS %M",
           str(bindir / "hvd-train"), "recipe=gpt", f"model.n_layer={args.layers}",
           f"model.n_embd={args.width}", "model.n_head=8", f"trainer.max_steps={args.steps}",
           "optim.warmup_steps=1", "data.batch_size_per_rank=2",
           "data.val_windows=4", "sample.new_tokens=0", "log.enabled=false", *strategy]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    found = {int(r): int(kb) / 1024 for r, kb in MAXRSS.findall(out)}
    if proc.returncode != 0 or len(found) != args.np:
        raise RuntimeError(f"{mode}: {' '.join(cmd)} exited {proc.returncode}, MAXRSS of ranks "
                           f"{sorted(found)}:\n{out[-3000:]}")
    return [found[r] for r in range(args.np)]


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--modes", default="stage0,stage1,stage2,ddp")
    args = p.parse_args()
    if shutil.which("/usr/bin/time") is None:
        raise SystemExit("bench/zero_rss.py needs GNU time at /usr/bin/time (Debian: apt-get install time)")
    sys.path.insert(0, str(ROOT))
    from recipes.gpt import GPTModule, ModelConfig, OptimConfig

    shape = ModelConfig(n_layer=args.layers, n_embd=args.width, n_head=8)
    params = GPTModule(shape, OptimConfig(), args.steps).net.num_params()
    n = args.np
    print(f"ZERO_RSS np={n} params={params / 1e6:.1f}M layers={args.layers} width={args.width} "
          f"load_average_before={os.getloadavg()[0]:.2f}", flush=True)
    per_param = {"stage0": 16, "stage1": 4 + 4 + 8 / n, "stage2": 4 + 12 / n, "ddp": 16}
    peaks: dict[str, float] = {}
    for mode in args.modes.split(","):
        rss = run_mode(mode, args)
        peaks[mode] = max(rss)
        print(f"RSS {mode} peak_mib_per_rank={[round(x, 1) for x in rss]} model_states_mib="
              f"{per_param[mode] * params / 2**20:.1f} (formula)", flush=True)
    for stage in ("stage1", "stage2"):
        for base in ("stage0", "ddp"):
            if stage in peaks and base in peaks:
                print(f"RATIO zero{stage[-1]}_peak_rss_vs_{base}={peaks[stage] / peaks[base]:.3f} (N={n})")
    print(f"ZERO_RSS done load_average_after={os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()

"""The main job's learning curve: validation loss against training time for the GPT recipe.

Run:  .venv/bin/python bench/gpt_curve.py [--np 2] [--val-every 50] [--val-windows 256]
                                          [--out bench/gpt_curve.png] [OVERRIDE ...]

Runs ``hvdrun -np N hvd-train recipe=gpt trainer.val_every_n_steps=K data.val_windows=W
OVERRIDE...`` (the demo of ``make demo`` with a validation every K steps on W windows spread
over the validation text, 0: all of it, as the demo's final validation), reads the recipe's
``val step <step>/<max> val_loss=<nats per byte> train_s=<s>`` lines (training time with the
validations taken out) and plots them with matplotlib (one line per ``--label``; several
``--runs`` files can be drawn together with ``--plot-only``). Prints one ``CURVE`` line per
validation, the recipe's ``RESULT`` line, and the load average before and after (figures from a
loaded machine are not comparable).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VAL_LINE = re.compile(r"val step (\d+)/(\d+) val_loss=([0-9.]+) train_s=([0-9.]+)")


def run_curve(np_: int, val_every: int, val_windows: int, overrides: list[str]) -> tuple[list[dict], str]:
    """Run the recipe once; return the validation points (step, val_loss, train_s) and its
    RESULT line.

    Raises:
        RuntimeError: hvdrun failed (its output tail is in the message).
    """
    bindir = Path(sys.executable).parent
    cmd = [str(bindir / "hvdrun"), "-np", str(np_), str(bindir / "hvd-train"), "recipe=gpt",
           f"trainer.val_every_n_steps={val_every}", f"data.val_windows={val_windows}", *overrides]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{out[-3000:]}")
    by_step = {int(m.group(1)): {"step": int(m.group(1)), "val_loss": float(m.group(3)),
                                 "train_s": float(m.group(4))}
               for m in VAL_LINE.finditer(out)}  # the final validation repeats the last step's
    points = sorted(by_step.values(), key=lambda p: p["step"])
    result = next((line for line in out.splitlines() if "RESULT" in line), "")
    sample = ""
    if "----- sample" in out:
        sample = out.split("----- sample -----")[-1].split("------------------")[0]
    if sample:
        print("sample:" + sample.rstrip(), flush=True)
    return points, result


def plot(runs: dict[str, list[dict]], out: Path, target: float | None) -> None:
    """val_loss (nats per byte) against training seconds, one line per run; ``target``: a
    dashed reference line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, points in runs.items():
        ax.plot([p["train_s"] for p in points], [p["val_loss"] for p in points], marker="o", ms=3,
                label=label)
    if target is not None:
        ax.axhline(target, ls="--", color="grey", lw=1, label=f"{target} (nanoGPT CPU, tiny Shakespeare)")
    ax.set_xlabel("training time (s, validation excluded)")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.set_title("GPT recipe, hvdrun -np 2 on 2 CPU cores")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--val-every", type=int, default=50, help="optimizer steps between validations")
    p.add_argument("--val-windows", type=int, default=0, help="0: all of the validation text")
    p.add_argument("--label", default="make demo")
    p.add_argument("--runs", type=Path, default=None, help="JSON file: the points of every run so far "
                   "(this run's are added under --label)")
    p.add_argument("--plot-only", action="store_true", help="only draw --runs")
    p.add_argument("--target", type=float, default=1.88)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "gpt_curve.png")
    p.add_argument("overrides", nargs="*", help="recipe overrides (omegaconf dotlist)")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {}
    if args.runs is not None and args.runs.exists():
        runs = json.loads(args.runs.read_text())
    if not args.plot_only:
        print(f"LOAD before={os.getloadavg()[0]:.2f}", flush=True)
        points, result = run_curve(args.np, args.val_every, args.val_windows, args.overrides)
        print(f"LOAD after={os.getloadavg()[0]:.2f}", flush=True)
        for pt in points:
            print(f"CURVE label={args.label!r} step={pt['step']} train_s={pt['train_s']} "
                  f"val_loss={pt['val_loss']}")
        print(result, flush=True)
        runs[args.label] = points
        if args.runs is not None:
            args.runs.write_text(json.dumps(runs, indent=1))
    plot(runs, args.out, args.target)


if __name__ == "__main__":
    main()

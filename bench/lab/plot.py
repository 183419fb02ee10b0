"""``python -m bench.lab.plot RECORDS.jsonl OUT.png``: samples/s vs link rate, one line per mode;
``python -m bench.lab.plot --curves RECORDS.jsonl OUT.png``: the ``slow_link`` workload's
val_loss vs training time, one panel per link rate, one line per mode.

Reads the records a lab run wrote with ``--records`` (several runs' files may be concatenated)
and draws, for each workload with distributed modes, the median samples/s (tokens/s for the GPT
recipe) of every mode at every shaped rate, with the compute-only ``local`` mode times the world
size as the ceiling (what the ranks would reach if communication were free).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.lab.net import parse_rate
from bench.lab.records import summarise

__all__ = ["plot", "plot_curves"]


def plot(records: list[dict], out: Path) -> None:
    """Write the figure to ``out`` (PNG). Unshaped rates are left out (no x position)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shaped = [r for r in records if r.get("rate") and parse_rate(r["rate"]) is not None
              and r["workload"] != "allreduce"]
    workloads = sorted({r["workload"] for r in shaped})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        recs = [r for r in shaped if r["workload"] == workload]
        s = summarise(recs, key=("workload", "mode", "rate"))
        world = max(r.get("world", 1) for r in recs)
        for mode in sorted({k[1] for k in s}):
            local = mode.endswith("local")  # one process's compute: x world is the ceiling
            points = sorted((parse_rate(k[2]) / 1e6, v.samples_per_s * (world if local else 1))
                            for k, v in s.items() if k[1] == mode)
            style = {"linestyle": "--", "color": "grey", "marker": "x"} if local else {"marker": "o"}
            label = f"{mode}: compute only, x{world}" if local else mode
            ax.plot([p[0] for p in points], [p[1] for p in points], label=label, **style)
        ax.set_xscale("log")
        ax.set_xlabel("link rate per host, Mbit/s (tc TBF)")
        ax.set_ylabel("tokens/s" if "gpt" in workload else "samples/s")
        ax.set_title(workload)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_curves(records: list[dict], out: Path) -> None:
    """Write val_loss vs training seconds (rank 0's curve of every ``slow_link`` run; the last run
    of a (rate, mode), as :func:`bench.lab.slow_link.load_runs`) to ``out``, with the target as a
    dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.lab.slow_link import load_runs

    by_rate = load_runs(records)
    rates = sorted(by_rate, key=lambda rate: parse_rate(rate) or float("inf"))
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.2), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        runs, _, target = by_rate[rate]
        for mode in sorted(runs):
            curve = runs[mode][0]["curve"]
            ax.plot([p["seconds"] for p in curve], [p["val_loss"] for p in curve], marker=".", label=mode)
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target (sync fp32 final)")
        ax.set_xlabel("training seconds (validation excluded)")
        ax.set_ylabel("val_loss (Shakespeare bytes)")
        ax.set_title(f"GPT, 2 hosts x 1 process, {rate}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    args = sys.argv[1:]
    curves = args[:1] == ["--curves"]
    args = args[1:] if curves else args
    if len(args) != 2:
        raise SystemExit(" ".join(__doc__.split("\n\n")[0].split()))
    lines = Path(args[0]).read_text().splitlines()
    (plot_curves if curves else plot)([json.loads(line) for line in lines if line.strip()], Path(args[1]))


if __name__ == "__main__":
    main()

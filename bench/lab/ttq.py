"""The ``ttq`` workload's arithmetic and report: time to DDP's quality, per seed and mode.

Every run trains the GPT recipe's model with the recipe's AdamW and lr schedule (warm-up, cosine
decay over ``steps``: ``bench.slow_link_training --schedule-steps``). The target of a seed is the
val_loss of DDP fp32 (torch's ``DistributedDataParallel``, default buckets) after ``steps``
optimizer steps of that seed. DDP reaches it at step ``steps`` by
definition: its time is that run's training seconds when it ran on the link, or, when the target
was trained elsewhere (given: at 20 Mbit/s a 1,500-step DDP run of the GPT model takes about 17
minutes per seed), ``steps`` times DDP's step time measured on the link (``ddp_step_s``, the
slowest rank's seconds per step over a short timed window; a DDP step does the same work all
along the run). Every other mode trains on the link itself, validating every ``eval_every`` steps (outside
the timed seconds), at least to the first validation at or after ``steps`` (its val_loss there
is the equal-tokens figure) and on until it validates at or below the target; its time to the
target is the training seconds at that first validation.

``python -m bench.lab.ttq RECORDS.jsonl`` prints the report again from a lab run's records.

Lines: ``TTQ <tag> seed=<s> ...`` per seed (the target, DDP's step time) and per seed and mode
(steps and seconds to the target, val_loss at equal tokens, speed-up over DDP), then per mode
``RATIO <tag>_ttq_<mode>_speedup_vs_ddp=<median> spread=<min>-<max> seeds=<n>`` and
``RATIO <tag>_ttq_<mode>_val_at_<k>_vs_target=...`` (medians over the seeds).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from bench.lab.records import median_spread

__all__ = ["TARGET", "DDP_STEP", "equal_tokens_step", "report", "main"]

TARGET = "ttq_target"
"""``ttq`` value of the records of a seed's target run (DDP fp32, ``steps`` steps)."""
DDP_STEP = "ttq_ddp_step"
"""``ttq`` value of the records of a seed's DDP step-time run."""


def equal_tokens_step(steps: int, eval_every: int) -> int:
    """The first validation step at or after ``steps``: where a mode's val_loss is compared with
    the target at (nearly) equal tokens."""
    return math.ceil(steps / eval_every) * eval_every


def _step_s(recs: list[dict]) -> float:
    """The slowest rank's seconds per timed step."""
    return max(r["seconds"] / r["steps"] for r in recs)


def report(tag: str, records: list[dict], steps: int, eval_every: int) -> dict[str, dict[int, float]]:
    """Print the ``TTQ`` and ``RATIO`` lines of one lab rate's ``ttq`` records (every rank's, each
    with ``seed`` and ``ttq``: :data:`TARGET`, :data:`DDP_STEP` or the mode); return each mode's
    speed-up over DDP by seed (0 where the mode never reached the target)."""
    seeds = sorted({r["seed"] for r in records})
    at = equal_tokens_step(steps, eval_every)
    speedups: dict[str, dict[int, float]] = {}
    equal_tokens: dict[str, dict[int, float]] = {}
    for seed in seeds:
        mine = [r for r in records if r["seed"] == seed]
        targets = [r for r in mine if r["ttq"] == TARGET]
        target = targets[0]["val_loss"]
        ddp_s = _step_s([r for r in mine if r["ttq"] == DDP_STEP])
        if targets[0].get("given"):  # trained elsewhere: DDP's time from its step time here
            ddp_time, how = steps * ddp_s, f"= {steps} x ddp_step_s"
        else:  # trained on this link: its own training seconds
            ddp_time, how = max(r["seconds"] for r in targets), "measured"
        print(f"TTQ {tag} seed={seed} target_val_loss={target:.4f} (DDP fp32 after {steps} steps) "
              f"ddp_step_s={ddp_s:.4f} ddp_time_to_target_s={ddp_time:.1f} ({how})", flush=True)
        modes = list(dict.fromkeys(r["ttq"] for r in mine if r["ttq"] not in (TARGET, DDP_STEP)))
        for mode in modes:
            curve = next(r for r in mine if r["ttq"] == mode)["curve"]
            hit = next((p for p in curve if p["val_loss"] <= target), None)
            val_at = next((p["val_loss"] for p in curve if p["step"] == at), math.nan)
            speedup = ddp_time / hit["seconds"] if hit else 0.0  # never reached: counts as 0
            speedups.setdefault(mode, {})[seed] = speedup
            equal_tokens.setdefault(mode, {})[seed] = val_at / target
            print(f"TTQ {tag} seed={seed} {mode} steps_to_target={hit['step'] if hit else 'never'} "
                  f"time_to_target_s={format(hit['seconds'], '.1f') if hit else 'never'} "
                  f"val_loss_at_{at}={val_at:.4f} last_step={curve[-1]['step']} "
                  f"speedup_vs_ddp={speedup:.2f}", flush=True)
    for mode, by_seed in speedups.items():
        name = mode.replace(":", "")
        speedup_line = median_spread(list(by_seed.values()), count="seeds")
        quality_line = median_spread(list(equal_tokens[mode].values()), count="seeds")
        print(f"RATIO {tag}_ttq_{name}_speedup_vs_ddp {speedup_line}", flush=True)
        print(f"RATIO {tag}_ttq_{name}_val_at_{at}_vs_target {quality_line}", flush=True)
    return speedups


def main(argv: list[str] | None = None) -> None:
    """Print the report of every rate in the records files (JSON lines of a lab run)."""
    lines = [line for path in (argv or sys.argv[1:]) for line in Path(path).read_text().splitlines()]
    records = [json.loads(line) for line in lines if line.strip()]
    records = [r for r in records if "ttq" in r]
    for rate in dict.fromkeys(r["rate"] for r in records):
        mine = [r for r in records if r["rate"] == rate]
        report(f"lab_{rate}", mine, mine[0]["ttq_steps"], mine[0]["ttq_eval_every"])


if __name__ == "__main__":
    main()

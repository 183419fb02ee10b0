"""The ``slow_link`` workload's arithmetic and report: time to a target val_loss per mode.

``python -m bench.lab.slow_link RECORDS.jsonl [MORE.jsonl ...]`` prints the report again from
the records of one or more lab runs (``--records``; a later file's run of a (rate, mode) replaces
an earlier one's, so one mode can be re-measured without re-running the others).

Lines: ``SLOW <tag> <mode> ...`` (steps, training seconds, time to target, val_loss at the
synchronous runs' step count, bytes per token) and ``RATIO`` lines: the speed-up of the time to
target against DDP fp32 and against DDP's PowerSGD hook, val_loss at equal tokens against
``sync``, and ``sync``'s bytes per token over each mode's (comm-counted and on the interface).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["report", "main"]


def _ratio(name: str, value: float) -> None:
    print(f"RATIO {name}={value:.3f}", flush=True)


def _time_to(curve: list[dict], target: float) -> float | None:
    """Training seconds at the first validation with ``val_loss <= target`` (``None``: never)."""
    return next((p["seconds"] for p in curve if p["val_loss"] <= target), None)


def _at_step(curve: list[dict], step: int) -> float | None:
    return next((p["val_loss"] for p in curve if p["step"] == step), None)


def _per_token(recs: list[dict]) -> tuple[float, float]:
    """(bytes the busiest rank's comm layer sent, bytes of the busiest direction of the busiest
    host interface) per global training token; the first is -1 where not counted (DDP)."""
    r0 = recs[0]
    tokens = r0["steps"] * r0["tokens_per_step"]
    comm = max(r["comm_bytes_sent"] for r in recs)
    wire = max(max(r["tx"], r["rx"]) for r in recs)
    return (comm / tokens if comm >= 0 else -1.0), wire / tokens


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "never" if value is None else format(value, spec)


def report(tag: str, runs: dict[str, list[dict]], steps: int, target: float) -> None:
    """Print the ``SLOW`` and ``RATIO`` lines of ``runs`` (mode -> every rank's record)."""
    times: dict[str, float | None] = {}
    for mode, recs in runs.items():
        curve = recs[0]["curve"]
        times[mode] = _time_to(curve, target)
        comm, wire = _per_token(recs)
        print(f"SLOW {tag} {mode} steps={recs[0]['steps']} seconds={max(r['seconds'] for r in recs):.1f} "
              f"time_to_target_s={_fmt(times[mode])} val_loss_at_{steps}_steps="
              f"{_fmt(_at_step(curve, steps), '.4f')} final_val_loss={curve[-1]['val_loss']:.4f} "
              f"comm_bytes_per_token={'n/a' if comm < 0 else f'{comm:.2f}'} "
              f"wire_bytes_per_token={wire:.2f}", flush=True)
    sync = runs.get("sync")
    sync_at = _at_step(sync[0]["curve"], steps) if sync else None
    sync_comm, sync_wire = _per_token(sync) if sync else (0.0, 0.0)
    for mode, recs in runs.items():
        if mode == "sync":
            continue
        for base in ("ddp", *(m for m in runs if m.startswith("ddp_powersgd"))):
            if mode != base and times.get(base) and times[mode]:
                _ratio(f"{tag}_slow_link_{mode}_time_to_target_speedup_vs_{base}", times[base] / times[mode])
        at = _at_step(recs[0]["curve"], steps)
        if at is not None and sync_at:
            _ratio(f"{tag}_slow_link_{mode}_val_loss_at_equal_tokens_vs_sync", at / sync_at)
        comm, wire = _per_token(recs)
        if comm > 0 and sync_comm > 0:
            _ratio(f"{tag}_slow_link_sync_vs_{mode}_comm_bytes_per_token", sync_comm / comm)
        if sync_wire:
            _ratio(f"{tag}_slow_link_sync_vs_{mode}_wire_bytes_per_token", sync_wire / wire)


def load_runs(records: list[dict]) -> dict[str, tuple[dict[str, list[dict]], int, float]]:
    """``rate -> (mode -> ranks' records, synchronous steps, target)`` of the ``slow_link`` records;
    for a (rate, mode) run more than once, the last run's records. The target and step count are
    the ``sync`` run's (else those any record carries)."""
    by_rate: dict[str, dict[str, list[dict]]] = {}
    for rec in records:
        if not rec.get("curve") or "target_val_loss" not in rec:
            continue
        ranks = by_rate.setdefault(rec["rate"], {}).setdefault(rec["mode"], [])
        if any(r["rank"] == rec["rank"] for r in ranks):
            ranks.clear()  # a newer run of this mode
        ranks.append(rec)
    out = {}
    for rate, runs in by_rate.items():
        ref = runs.get("sync") or next(iter(runs.values()))
        steps = ref[0]["steps"] if "sync" in runs else int(ref[0].get("sync_steps", 0))
        out[rate] = (runs, steps, float(ref[0]["target_val_loss"]))
    return out


def main(argv: list[str] | None = None) -> None:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        raise SystemExit(" ".join(__doc__.split("\n\n")[1].split()))
    records = [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line.strip()]
    for rate, (runs, steps, target) in load_runs(records).items():
        report(f"lab_{rate}", runs, steps, target)


if __name__ == "__main__":
    main()

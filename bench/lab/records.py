"""The lab's arithmetic: ``LAB`` records -> step time, bytes on the wire, efficiency.

A record is one rank's timed window (``seconds``, ``steps``, and its host's ``tx``/``rx``
interface bytes over that window). For one (workload, mode, round, size) the window is the
slowest rank's, and the bytes the busiest host's busiest direction (every host has its own
full-duplex port, so the busiest direction of the busiest port bounds the step). Rounds are
summarised by their median.

Wire efficiency (the issue's definition): ``max(compute_s, bytes_per_step / wire_bytes_per_s)
/ step_s``, where ``compute_s`` is the same step with no communication (``local`` mode) and
``wire_bytes_per_s`` what iperf3's stream moved on the same counters.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass

__all__ = ["Summary", "median_spread", "parse", "summarise", "wire_efficiency"]

_LINE = re.compile(r"LAB (\{.*\})")


def parse(outputs: list[str]) -> list[dict]:
    """Every ``LAB {json}`` record in the hosts' outputs (behind hvdrun's rank prefixes or not)."""
    return [json.loads(m.group(1)) for out in outputs for m in _LINE.finditer(out)]


@dataclass(frozen=True)
class Summary:
    """One mode of one workload over its rounds (medians).

    Attributes:
        step_s: seconds per step (or per call), slowest rank.
        bytes_per_step: link-layer bytes per step in the busiest direction of the busiest port.
        samples_per_s: global samples (or tokens, for the GPT recipe) per second.
        rounds: how many rounds were summarised.
    """

    step_s: float
    bytes_per_step: float
    samples_per_s: float
    rounds: int


def summarise(records: list[dict], key: tuple[str, ...] = ("workload", "mode")) -> dict[tuple, Summary]:
    """Group records by ``key`` (plus round), combine ranks as described above, median over rounds."""
    windows: dict[tuple, list[dict]] = defaultdict(list)
    for rec in records:
        windows[(*(rec.get(k) for k in key), rec["round"])].append(rec)
    per_key: dict[tuple, list[tuple[float, float, float]]] = defaultdict(list)
    for k, recs in windows.items():
        steps = recs[0]["steps"]
        seconds = max(r["seconds"] for r in recs)
        by_host: dict[str, float] = defaultdict(float)
        for r in recs:
            by_host[r["host"]] = max(by_host[r["host"]], r["tx"], r["rx"])
        samples = recs[0].get("batch", 0) * recs[0].get("world", 1) * steps
        per_key[k[:-1]].append((seconds / steps, max(by_host.values()) / steps, samples / seconds))
    return {
        k: Summary(statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals),
                   statistics.median(v[2] for v in vals), len(vals))
        for k, vals in per_key.items()
    }


def wire_efficiency(step_s: float, compute_s: float, bytes_per_step: float, wire_bytes_per_s: float) -> float:
    """``max(compute_s, bytes_per_step / wire_bytes_per_s) / step_s`` (1.0: the step runs at
    whichever of the CPU or the link is the limit)."""
    return max(compute_s, bytes_per_step / wire_bytes_per_s) / step_s


def median_spread(values: list[float], *, digits: int = 3, count: str = "rounds") -> str:
    """``median=<m> spread=<min>-<max> <count>=<n>`` of ``values`` (non-empty), ``digits``
    decimals: how every lab line reports a figure measured more than once."""
    f = f".{digits}f"
    return (f"median={statistics.median(values):{f}} spread={min(values):{f}}-{max(values):{f}} "
            f"{count}={len(values)}")

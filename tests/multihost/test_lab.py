"""The shaped-link lab's smoke run (CI): one rate, a few steps, values checked against the wire.

``python -m bench.lab --rates 100mbit --workloads allreduce,loop`` on two namespace hosts: the
iperf3 goodput must be close to the shaped rate (the shaping works), the CNN's step must move the
gradient bytes a 2-rank ring allreduce moves (closed form: 4 bytes x parameters each way), half
that with bf16 (ours and DDP's hook), and the lab must leave no namespace behind.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lab.models import ResNetSmall
from bench.lab.records import summarise
from tests.e2e.hvdrun_helpers import ROOT, clean_env

pytestmark = pytest.mark.timeout(600)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("hvt")}


def test_lab_smoke_at_100mbit(tmp_path: Path) -> None:
    before = _namespaces()
    records = tmp_path / "records.jsonl"
    cmd = [sys.executable, "-m", "bench.lab", "--rates", "100mbit", "--workloads", "allreduce,loop",
           "--rounds", "1", "--steps", "2", "--warmup", "1", "--sizes", "1048576", "--iperf-seconds", "2",
           "--records", str(records)]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    print("\n".join(line for line in out.splitlines() if not line.startswith("[")))

    goodput = float(re.search(r"RATIO lab_100mbit_iperf3_goodput_vs_rate=(\S+)", out).group(1))
    assert 0.85 <= goodput <= 1.0, f"iperf3 carried {goodput:.3f} of the shaped 100 Mbit/s"
    busbw = float(re.search(r"RATIO lab_100mbit_allreduce_1048576_busbw_vs_iperf3=(\S+)", out).group(1))
    assert 0.3 <= busbw <= 1.1, busbw

    grad_bytes = 4 * sum(p.numel() for p in ResNetSmall().parameters())
    recs = [json.loads(line) for line in records.read_text().splitlines()]
    s = summarise([r for r in recs if r["workload"] == "loop"])
    for mode in ("hvd", "ddp"):
        per_step = s[("loop", mode)].bytes_per_step
        assert grad_bytes <= per_step <= 1.25 * grad_bytes, (mode, per_step, grad_bytes)
    for mode in ("hvd_bf16", "ddp_bf16"):
        per_step = s[("loop", mode)].bytes_per_step
        assert 0.5 * grad_bytes <= per_step <= 0.65 * grad_bytes, (mode, per_step, grad_bytes)
    # link-aware buckets: the probe saw about the shaped link, and the 3.9 MB of gradients are cut
    # into buckets of ~0.05 s on it (the one-host default would be 2 buckets: 1 MiB + the rest)
    (hvd,) = [r for r in recs if r["workload"] == "loop" and r["mode"] == "hvd" and r["rank"] == 0]
    link = float(re.search(r"LINK lab_100mbit goodput_bytes_per_s=(\d+)", out).group(1))
    assert 0.5 * link <= hvd["probed_bytes_per_s"] <= 2.0 * link, (hvd["probed_bytes_per_s"], link)
    assert len(hvd["bucket_bytes"]) >= 5, hvd["bucket_bytes"]
    local = s[("loop", "local")].bytes_per_step
    assert local < 0.01 * grad_bytes, f"the local (compute-only) mode sent {local} bytes per step"
    for mode in ("hvd", "ddp", "hvd_bf16", "ddp_bf16"):
        eff = float(re.search(rf"RATIO lab_100mbit_loop_{mode}_wire_efficiency=(\S+)", out).group(1))
        assert 0.0 < eff < 10.0, (mode, eff)  # compute is timed in another run: load moves it
    assert _namespaces() == before, "the lab left network namespaces behind"

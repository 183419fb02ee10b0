"""``Trainer(strategy="horovod", devices=2)``: ``python train.py`` starts its own second process;
under ``hvdrun -np 2`` it does not (exactly two ranks either way, same weights on both). When the
self-launched rank 1 is killed, rank 0 stops at once with an error that names rank 1."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCRIPT = str(ROOT / "tests" / "e2e" / "scripts" / "lightning_train.py")
RANK_LINE = re.compile(r"RANK (\d+)/(\d+) pid=(\d+) checksum=(-?\d+\.\d+)")


@functools.cache
def _lightning_detection_args() -> list[str]:
    """``[]`` normally; ``["--explicit-env"]`` where Lightning's MPIEnvironment.detect() crashes
    (mpi4py installed without an MPI library), which breaks any Trainer built without launcher
    variables, whatever the strategy."""
    probe = "from lightning_fabric.plugins.environments import MPIEnvironment; MPIEnvironment.detect()"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60)
    return [] if proc.returncode == 0 else ["--explicit-env"]


# name, command (before the detection args), expected number of RANK lines
CASES = [
    ("python self-launches", [sys.executable, SCRIPT], 2),
    ("hvdrun does not self-launch", [str(BIN / "hvdrun"), "-np", "2", "python", SCRIPT], 2),
]


def _run(cmd: list[str]) -> tuple[subprocess.CompletedProcess, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
    return proc, f"command: {' '.join(cmd)}\nexit code: {proc.returncode}\n--- output tail ---\n{tail}"


@pytest.mark.parametrize(("name", "cmd", "ranks"), CASES, ids=[c[0] for c in CASES])
def test_launch_modes(name: str, cmd: list[str], ranks: int) -> None:
    proc, context = _run([*cmd, *_lightning_detection_args()])
    assert proc.returncode == 0, context
    found = RANK_LINE.findall(proc.stdout)
    assert len(found) == ranks, context
    assert sorted(int(r) for r, *_ in found) == list(range(ranks)), context
    assert {int(w) for _, w, _, _ in found} == {ranks}, context
    assert len({pid for _, _, pid, _ in found}) == ranks, context
    assert len({c for *_, c in found}) == 1, f"weights differ across ranks\n{context}"


# killed rank, substrings the survivor's output must hold
KILLS = [
    ("1", ["RankFailedError: bucket", "because rank 1 (pid {pid} on"]),
    # rank 0 hosts the job's store when Lightning self-launches: the survivor names that
    ("0", ["RankFailedError: bucket", "lost the job's key-value store"]),
]


@pytest.mark.parametrize(("victim", "expected"), KILLS, ids=[f"kill-rank{k[0]}" for k in KILLS])
def test_killed_self_launched_rank_is_named(victim: str, expected: list[str]) -> None:
    proc, context = _run([sys.executable, SCRIPT, f"--kill-rank{victim}", *_lightning_detection_args()])
    ended = time.time()
    assert proc.returncode != 0, context
    killed = re.search(r"KILLED pid=(\d+) at=(\d+\.\d+)", proc.stdout)
    assert killed, context
    output = proc.stdout + proc.stderr
    for needle in expected:
        assert needle.format(pid=killed.group(1)) in output, f"missing {needle!r}\n{context}"
    seconds = ended - float(killed.group(2))
    print(f"SCENARIO self-launch-sigkill-rank{victim}: the job ended {seconds:.1f} s after the kill")
    assert seconds < 30, context

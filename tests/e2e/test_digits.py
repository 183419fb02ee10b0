"""``hvdrun -np 2 hvd-train recipe=digits`` end to end, as a user runs it (subprocess, timeout)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RESULT = re.compile(
    r"^(?:\[0\]<stdout>:)?"  # hvdrun's rank prefix: rank 0 prints it
    r"RESULT world_size=(\d+) val_acc=(\d\.\d\d) epochs=(\d+) samples_per_s=(\d+\.\d) wall_s=(\d+\.\d)$"
)

# name, command, expected world size, expected epochs
CASES = [
    ("two ranks, two epochs",
     [str(BIN / "hvdrun"), "-np", "2", str(BIN / "hvd-train"), "recipe=digits", "trainer.max_epochs=2"],
     2, 2),
]


@pytest.mark.parametrize(("name", "cmd", "world", "epochs"), CASES, ids=[c[0] for c in CASES])
def test_digits_result_line(name: str, cmd: list[str], world: int, epochs: int) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    tail = "\n".join(output.splitlines()[-200:])  # the whole of a failed run: its first error too
    context = f"command: {' '.join(cmd)}\nexit code: {proc.returncode}\n--- output tail ---\n{tail}"
    assert proc.returncode == 0, context
    lines = [m for m in map(RESULT.match, proc.stdout.splitlines()) if m]
    assert len(lines) == 1, f"expected exactly one RESULT line (rank 0 only)\n{context}"
    got = lines[0]
    assert int(got[1]) == world and int(got[3]) == epochs, context
    assert 0.0 <= float(got[2]) <= 1.0 and float(got[4]) > 0 and float(got[5]) > 0, context
    # accuracy is a fraction of the 360 validation images; 2 epochs of SGD already beat chance
    assert float(got[2]) > 0.5, context

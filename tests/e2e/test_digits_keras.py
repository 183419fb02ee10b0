"""``hvdrun -np 2 hvd-train recipe=digits_keras`` on both Keras backends (subprocess, timeout)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# (name, extra overrides, expected minimum val_acc)
CASES = [
    ("tensorflow", ["keras.backend=tensorflow"], 0.95),
    ("torch", ["keras.backend=torch"], 0.95),
]


@pytest.mark.parametrize(("name", "overrides", "min_acc"), CASES, ids=[c[0] for c in CASES])
def test_digits_keras_two_processes(name, overrides, min_acc):
    cmd = [str(BIN / "hvdrun"), "-np", "2", str(BIN / "hvd-train"), "recipe=digits_keras", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    tail = "\n".join(out.splitlines()[-30:])
    assert proc.returncode == 0, f"command: {' '.join(cmd)}\n{tail}"
    results = re.findall(r"^(?:\[0\]<stdout>:)?RESULT world_size=(\d+) val_acc=([\d.]+) epochs=(\d+) .*$",
                         proc.stdout, re.M)  # behind hvdrun's rank prefix: rank 0 prints it
    assert len(results) == 1, f"command: {' '.join(cmd)}\nexpected one RESULT line (rank 0)\n{tail}"
    world_size, val_acc, _ = results[0]
    assert int(world_size) == 2
    assert float(val_acc) >= min_acc, f"command: {' '.join(cmd)}\n{tail}"
    # Only rank 0 prints Keras progress: one "Epoch 1/N" line, not one per rank.
    assert len(re.findall(r"^(?:\[\d+\]<stdout>:)?Epoch 1/\d+$", proc.stdout, re.M)) == 1, tail

"""Elastic recovery end to end: rank 1 is SIGKILLed mid-epoch, torchrun restarts both workers,
they resume from the last commit, and the final weights equal an uninterrupted run's."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tests.e2e.hvdrun_helpers import SCRIPTS, alive, fail_time, hvdrun, pids_from

WORKER = str(SCRIPTS / "elastic_worker.py")
KILL_STEP = 10  # commits happen every 3 steps, so the last commit before the kill is step 9
STEPS = 24  # 3 epochs x 64 samples / (2 ranks x batch 4)


def test_killed_worker_resumes_from_last_commit_with_identical_result(tmp_path: Path) -> None:
    ref = hvdrun(["-np", "2", "python", WORKER, str(tmp_path / "ref"), str(tmp_path / "ref.pt"), "-1"],
                 timeout=150)
    assert ref.returncode == 0, ref.explain()
    res = hvdrun(["-np", "2", "--min-np", "2", "--max-np", "2", "python", WORKER,
                  str(tmp_path / "run"), str(tmp_path / "run.pt"), str(KILL_STEP)], timeout=240)
    assert res.returncode == 0, res.explain()
    assert "START rank=1 attempt=0 step=0" in res.output, res.explain()
    for rank in (0, 1):
        # resumed from the last commit, which was not lost
        assert f"START rank={rank} attempt=1 step=9 epoch=1" in res.output, res.explain()
        assert f"DONE rank={rank} step={STEPS}" in res.output, res.explain()
    assert alive(pids_from(res.output)) == [], res.explain()

    restart = float(re.search(r"START rank=0 attempt=1 .* at=(\d+\.\d+)", res.output).group(1))
    seconds = restart - fail_time(res.output)
    print(f"SCENARIO elastic-sigkill: workers restarted and resumed {seconds:.1f} s after the kill")
    assert seconds < 60, res.explain()

    want, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "run.pt")
    assert got["step"] == want["step"] == STEPS
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name  # bit-identical
    assert got["seen"] == want["seen"]
    for epoch in range(3):  # every sample exactly once per epoch
        indices = sorted(i for e, batch in got["seen"] if e == epoch for i in batch)
        assert indices == list(range(64)), (epoch, indices)

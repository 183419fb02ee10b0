"""Elastic recovery end to end: rank 1 is SIGKILLed mid-epoch, torchrun restarts both workers,
they resume from the last commit, and the final weights equal an uninterrupted run's."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hvd_trainer.elastic import STATE_FILENAME
from tests.e2e.hvdrun_helpers import SCRIPTS, Result, alive, clean_env, fail_time, hvdrun, pids_from

WORKER = str(SCRIPTS / "elastic_worker.py")
KILL_STEP = 10  # commits happen every 3 steps, so the last commit before the kill is step 9
STEPS = 24  # 3 epochs x 64 samples / (2 ranks x batch 4)


@dataclass
class KilledRun:
    result: Result
    out_file: Path
    """Rank 0's final weights and committed per-step sample indices."""
    tmp: Path
    """The job's TMPDIR, which holds the automatic commit directory while it runs."""
    left_behind: list[int]
    """Workers still running right after hvdrun exited (looked up then: a test may run later)."""


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> KilledRun:
    """The elastic job whose rank 1 is SIGKILLed at step 10, committing to the automatic
    directory (<tmp>/hvd_trainer_elastic/<run id>) in a temp folder of its own. Both tests check
    it: one the resumed result, the other the lines and files recovery leaves."""
    base = tmp_path_factory.mktemp("elastic")
    tmp = base / "tmp"
    tmp.mkdir()
    res = hvdrun(["-np", "2", "--min-np", "2", "--max-np", "2", "--recovery", "restart", "python", WORKER,
                  "default", str(base / "run.pt"), str(KILL_STEP)], timeout=240,
                 env=clean_env(TMPDIR=str(tmp)))
    return KilledRun(res, base / "run.pt", tmp, alive(pids_from(res.output)))


def test_killed_worker_resumes_from_last_commit_with_identical_result(tmp_path: Path,
                                                                      killed_run: KilledRun) -> None:
    ref = hvdrun(["-np", "2", "python", WORKER, str(tmp_path / "ref"), str(tmp_path / "ref.pt"), "-1"],
                 timeout=150)
    assert ref.returncode == 0, ref.explain()
    assert (tmp_path / "ref" / STATE_FILENAME).is_file()  # an explicit checkpoint_dir keeps its commit
    res = killed_run.result
    assert res.returncode == 0, res.explain()
    assert "START rank=1 attempt=0 step=0" in res.output, res.explain()
    for rank in (0, 1):
        # resumed from the last commit, which was not lost
        assert f"START rank={rank} attempt=1 step=9 epoch=1" in res.output, res.explain()
        assert f"DONE rank={rank} step={STEPS}" in res.output, res.explain()
    assert killed_run.left_behind == [], res.explain()

    restart = float(re.search(r"START rank=0 attempt=1 .* at=(\d+\.\d+)", res.output).group(1))
    seconds = restart - fail_time(res.output)
    print(f"SCENARIO elastic-sigkill: workers restarted and resumed {seconds:.1f} s after the kill")
    assert seconds < 60, res.explain()

    want, got = torch.load(tmp_path / "ref.pt"), torch.load(killed_run.out_file)
    assert got["step"] == want["step"] == STEPS
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name  # bit-identical
    assert got["seen"] == want["seen"]
    for epoch in range(3):  # every sample exactly once per epoch
        indices = sorted(i for e, batch in got["seen"] if e == epoch for i in batch)
        assert indices == list(range(64)), (epoch, indices)


def test_recovery_is_one_line_per_survivor_names_one_pid_and_leaves_no_temp_files(
        killed_run: KilledRun) -> None:
    res, tmp = killed_run.result, killed_run.tmp
    assert res.returncode == 0, res.explain()
    for rank in (0, 1):
        assert f"START rank={rank} attempt=1 step=9 epoch=1" in res.output, res.explain()
        assert f"DONE rank={rank} step={STEPS}" in res.output, res.explain()
    # the survivor says it stopped in at most one line (the agent may SIGTERM it first), no traceback
    assert "Traceback" not in res.output, res.explain()
    survivor = [line for line in res.output.splitlines() if "elastic: rank" in line]
    assert len(survivor) <= 1, res.explain()
    if survivor:
        assert survivor[0].startswith("[0]<stderr>:elastic: rank 0 stopped: RankFailedError: ")
        assert survivor[0].endswith("the workers restart from the last commit (restart 1 of 3)"), survivor
    # hvdrun names rank 1 by the pid rank 1 itself printed (its script's, not the worker entry's)
    killed_pid = int(re.search(r"(?m)^\[1\]<stdout>:PID 1 (\d+)$", res.output).group(1))
    assert f"hvdrun: rank 1 (local rank 1, pid {killed_pid}) failed with signal SIGKILL" in res.output
    assert "closing signal SIGTERM" not in res.output and "(pid: " not in res.output  # torchrun's lines
    # nothing left: no commit directory, no torchrun log folders, no hvdrun job directory
    left = sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [], (left, list(tmp.rglob("*")))

"""hvdrun as horovodrun: Horovod's worker variables, whole rank-prefixed lines, and the elastic
retry policy (only a peer's failure is retried; restarts are announced and counted)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hvd_trainer.launch.commands import find_mpirun
from tests.e2e.hvdrun_helpers import SCRIPTS, Result, clean_env, hvdrun, last_line
from tests.e2e.shared_launches import PROBE_PREFIXES

ELASTIC = ["--min-np", "2", "--max-np", "2", "--max-restarts", "2", "--recovery", "restart"]


def test_horovod_variables_reach_every_worker(plain_probe: Result) -> None:
    res = plain_probe
    assert res.returncode == 0, res.explain()
    assert "[0]<stdout>:VARS 0 2 0 2 0 1 True" in res.output, res.explain()
    assert "[1]<stdout>:VARS 1 2 1 2 0 1 True" in res.output, res.explain()


def test_lines_are_prefixed_by_rank_and_never_merged(plain_probe: Result) -> None:
    # Each rank writes 200 lines in three unflushed pieces, with no pause (conftest.LINES_CODE);
    # its other lines (PROBE_PREFIXES) come first, whole, and are left out of the comparison.
    res = plain_probe
    assert res.returncode == 0, res.explain()
    for rank in (0, 1):
        prefix = f"[{rank}]<stdout>:"
        lines = [ln for ln in res.output.splitlines()
                 if ln.startswith(prefix) and not ln[len(prefix):].startswith(PROBE_PREFIXES)]
        assert lines == [f"{prefix}line {i} of rank {rank}" for i in range(200)], res.explain()
        assert f"[{rank}]<stderr>:to stderr {rank}" in res.output, res.explain()
    stray = [ln for ln in res.output.splitlines()
             if "of rank" in ln and not re.match(r"^\[\d\]<stdout>:", ln)]
    assert stray == [], stray


def test_prefix_with_timestamp(stamped_probe: Result) -> None:
    res = stamped_probe
    assert res.returncode == 0, res.explain()
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    assert re.search(rf"(?m)^{stamp} \[1\]<stdout>:hi$", res.output), res.explain()


def test_user_exception_under_elastic_fails_at_once(tmp_path: Path) -> None:
    res = hvdrun([*ELASTIC, "-np", "2", "python", str(SCRIPTS / "elastic_user_error.py"), "user",
                  str(tmp_path)], timeout=150)
    assert res.returncode == 1, res.explain()
    line = last_line(res.output)
    assert line.startswith("hvdrun: error: rank 1 failed with exit code 1: ValueError: bad batch 2"), line
    assert "not retried; 0 of 2 restarts used" in line, line
    assert "restarting all workers" not in res.output, res.explain()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt.0.0", "attempt.0.1"]


def test_peer_failure_is_retried_and_announced(tmp_path: Path) -> None:
    res = hvdrun([*ELASTIC, "-np", "2", "python", str(SCRIPTS / "elastic_user_error.py"), "sigkill",
                  str(tmp_path)], timeout=200)
    assert res.returncode == 0, res.explain()
    assert re.search(r"hvdrun: rank 1 \(local rank 1, pid \d+\) failed with signal SIGKILL; "
                     r"restarting all workers \(attempt 1 of 2\)", res.output), res.explain()
    assert "[0]<stdout>:DONE 0 step=4" in res.output and "[1]<stdout>:DONE 1 step=4" in res.output
    assert last_line(res.output) == "hvdrun: 1 of 2 restarts used.", res.explain()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "attempt.0.0", "attempt.0.1", "attempt.1.0", "attempt.1.1"]


def test_lightning_callback_error_fails_the_job_without_restart(tmp_path: Path) -> None:
    res = hvdrun(["--max-restarts", "1", "-np", "2", "python", str(SCRIPTS / "lightning_user_error.py"),
                  str(tmp_path)], timeout=240)
    assert res.returncode == 1, res.explain()
    line = last_line(res.output)
    assert line.startswith("hvdrun: error: rank 1 failed with exit code 1: RuntimeError: report upload "
                           "failed: no such bucket"), line
    assert "0 of 1 restarts used" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt.0.0", "attempt.0.1"]


@pytest.mark.skipif(find_mpirun() is None, reason="needs Open MPI's mpirun (PATH or the venv)")
def test_mpirun_workers_get_horovod_variables_and_prefixes() -> None:
    code = "import os; print('VARS', os.environ['HOROVOD_RANK'], os.environ['HOROVOD_SIZE'])"
    env = clean_env(OMPI_MCA_rmaps_base_oversubscribe="1")
    res = hvdrun(["--mpi", "-np", "2", "python", "-c", code], env=env, timeout=120)
    assert res.returncode == 0, res.explain()
    assert "[0]<stdout>:VARS 0 2" in res.output and "[1]<stdout>:VARS 1 2" in res.output, res.explain()


def test_lightning_restart_is_announced_and_counted(tmp_path: Path) -> None:
    # Without --min-np/--max-np: the non-elastic path's restart (test_lightning_elastic runs the
    # elastic one), so this launch is not shared.
    res = hvdrun(["--max-restarts", "1", "-np", "2", "python", str(SCRIPTS / "lightning_elastic.py"),
                  str(tmp_path / "run.pt"), "4"], timeout=240)
    assert res.returncode == 0, res.explain()
    assert re.search(r"hvdrun: rank 1 \(local rank 1, pid \d+\) failed with signal SIGKILL; "
                     r"restarting all workers \(attempt 1 of 1\)", res.output), res.explain()
    assert last_line(res.output) == "hvdrun: 1 of 1 restarts used.", res.explain()

"""launch.runner.job_directory: hvdrun's HVDRUN_JOB_DIR, removed at the end, never failing a job."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hvd_trainer.launch import runner
from hvd_trainer.launch.runner import job_directory


def test_removed_at_the_end_with_what_the_workers_wrote() -> None:
    with job_directory() as path:
        assert path.is_dir() and path.name.startswith("hvdrun-job-")
        (path / "pid.0").write_text("123")
        (path / "torchelastic" / "attempt_0").mkdir(parents=True)
    assert not path.exists()


def test_a_directory_that_cannot_be_removed_is_named_and_left(monkeypatch, capsys) -> None:
    def refuse(path: Path, onerror: object = None) -> None:  # as when a worker writes meanwhile
        raise OSError(39, "Directory not empty", str(path))

    with job_directory() as path:
        monkeypatch.setattr(runner.shutil, "rmtree", refuse)
    monkeypatch.undo()
    try:
        err = capsys.readouterr().err
        assert path.is_dir()
        assert f"hvdrun: warning: could not remove the job's temporary directory {path}" in err
        assert "Directory not empty" in err and "HINT:" in err
    finally:
        shutil.rmtree(path)


def test_the_jobs_own_error_is_not_replaced() -> None:
    with pytest.raises(KeyboardInterrupt), job_directory() as path:
        raise KeyboardInterrupt
    assert not path.exists()

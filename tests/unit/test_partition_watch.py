"""hvdrun's side of a partition: it stops when its agent is stuck (launch.partition_watch), and an
agent that restarts its workers is not stuck (launch.agent_watch forgets the records)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hvd_trainer.launch.agent_watch import AgentWatch
from hvd_trainer.launch.partition_watch import PartitionWatch, descendants, forget_partition_records

pytestmark = pytest.mark.timeout(60)


def _record(job_dir: Path, rank: int = 2) -> None:
    (job_dir / f"unreachable.{rank}.json").write_text(json.dumps(
        {"rank": rank, "host": "h2", "message": f"rank {rank} on h2 cannot reach the job's store at h1:1"}))


def test_a_stuck_agent_is_ended_after_the_grace_period_with_every_child_killed(tmp_path, capsys) -> None:
    exits: list[int] = []
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in descendants(os.getpid())
        _record(tmp_path)
        with PartitionWatch(tmp_path, grace_seconds=0.5, hard_exit=exits.append):
            deadline = time.monotonic() + 10
            while not exits and time.monotonic() < deadline:
                time.sleep(0.05)
        assert exits == [1]
        assert child.wait(timeout=10) == -9  # SIGKILLed
        err = capsys.readouterr().err
        assert "hvdrun: error: network partition: rank 2 on h2 cannot reach the job's store at h1:1" in err
        assert "hvdrun killed this host's workers" in err
    finally:
        child.kill()
        child.wait()


def test_records_forgotten_by_a_restarting_agent_stop_nothing(tmp_path) -> None:
    exits: list[int] = []
    failure = SimpleNamespace(exitcode=75, local_rank=0, pid=123, timestamp=0)
    agent = SimpleNamespace(_remaining_restarts=2)
    out = io.StringIO()
    watch = AgentWatch(tmp_path, max_restarts=3, out=out)
    with PartitionWatch(tmp_path, grace_seconds=1.0, hard_exit=exits.append):
        _record(tmp_path)
        time.sleep(0.5)
        watch.on_failure(agent, {0: failure})  # the agent restarts its workers: not stuck
        assert not list(tmp_path.glob("unreachable.*.json"))
        time.sleep(1.5)
    assert exits == [] and watch.restarts_used == 1 and "restarting all workers" in out.getvalue()


def test_forget_partition_records_removes_only_them(tmp_path) -> None:
    _record(tmp_path, 0)
    (tmp_path / "user_error.0.json").write_text("{}")
    forget_partition_records(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["user_error.0.json"]


def test_the_watch_has_stopped_reading_once_its_block_ends(tmp_path) -> None:
    """hvdrun removes the job directory right after the block: the watch must not list it then
    (CI once saw the watch's listing fail in the middle of that removal)."""
    watch = PartitionWatch(tmp_path, grace_seconds=60.0, hard_exit=lambda code: None)
    with watch:
        _record(tmp_path)
    assert not watch._thread.is_alive()


def test_a_removed_job_directory_reads_as_no_records(tmp_path) -> None:
    from hvd_trainer.comm.world.heartbeat import read_records

    job_dir = tmp_path / "job"
    job_dir.mkdir()
    _record(job_dir)
    assert [r["rank"] for r in read_records(job_dir)] == [2]
    shutil.rmtree(job_dir)
    assert read_records(job_dir) == []

"""Slurm for real: a single-node cluster (munged + slurmctld + slurmd, started by the test in a
temp dir) runs ``srun -n 2 python train.py`` and ``sbatch`` scripts; ``hvd.init()`` takes rank,
local rank, size and master from Slurm's variables alone.

The real-cluster tests skip (with the reason) without ``slurm-wlm``/``munge`` or root;
the detection tests on the environment a real ``srun`` set (captured from this cluster) always run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hvd_trainer.comm.world.world import detect_launch_env
from tests.e2e.hvdrun_helpers import ROOT, clean_env
from tests.engines.slurm_cluster import SlurmCluster, local_slurm, unavailable_reason

SCRIPT = Path(__file__).parent / "scripts" / "report_world.py"

# Rank 1 of `srun -n 2 env` on this test's cluster (Slurm 22.05, node "vm", job 1); the
# variables hvd_trainer reads plus the ones that tell a step from a batch script.
CAPTURED_SRUN_RANK1 = {
    "SLURM_CLUSTER_NAME": "hvdtest", "SLURM_CPUS_ON_NODE": "2", "SLURM_GTIDS": "0,1",
    "SLURM_JOBID": "1", "SLURM_JOB_CPUS_PER_NODE": "2", "SLURM_JOB_ID": "1", "SLURM_JOB_NAME": "env",
    "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_PARTITION": "debug",
    "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_LOCALID": "1", "SLURM_NNODES": "1",
    "SLURM_NODEID": "0", "SLURM_NODELIST": "vm", "SLURM_NPROCS": "2", "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "vm",
    "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_SUBMIT_HOST": "vm", "SLURM_TASKS_PER_NODE": "2", "SLURM_TOPOLOGY_ADDR": "vm",
}
# The batch script itself of `sbatch --ntasks=2` (same cluster, job 39750): one process.
CAPTURED_SBATCH_SCRIPT = {
    "ENVIRONMENT": "BATCH", "SLURM_CPUS_ON_NODE": "2", "SLURM_GTIDS": "0", "SLURM_JOB_ID": "39750",
    "SLURM_JOB_NAME": "sb.sh", "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_NUM_NODES": "1",
    "SLURM_LOCALID": "0", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NODELIST": "vm",
    "SLURM_NPROCS": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_TASKS_PER_NODE": "2",
}


def test_captured_srun_environment_gives_slurm_ranks() -> None:
    info = detect_launch_env(CAPTURED_SRUN_RANK1)
    assert (info.launcher, info.rank, info.size, info.local_rank, info.local_size) == ("slurm", 1, 2, 1, 2)
    assert (info.master_addr, info.master_port) == ("vm", 15001)  # first host; 15000 + job id


def test_captured_sbatch_script_environment_is_one_process() -> None:
    info = detect_launch_env(CAPTURED_SBATCH_SCRIPT)
    assert (info.launcher, info.rank, info.size) == ("none", 0, 1)
    step = {**CAPTURED_SBATCH_SCRIPT, "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
    assert detect_launch_env(step).launcher == "slurm"  # an srun step inside the batch job


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with local_slurm(tmp_path_factory.mktemp("slurm"), cpus=2) as cluster:
        yield cluster


def _env(cluster: SlurmCluster, out: Path) -> dict[str, str]:
    return clean_env(SLURM_CONF=cluster.env["SLURM_CONF"], HVD_TEST_OUT=str(out))


def _reports(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def _check(proc: subprocess.CompletedProcess, cluster: SlurmCluster, extra: str = "") -> None:
    assert proc.returncode == 0, (f"{proc.args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}\n{extra}\n{cluster.logs()}")


@pytest.mark.timeout(120)
def test_srun_two_tasks_init_reads_slurm_alone(slurm: SlurmCluster, tmp_path: Path) -> None:
    proc = subprocess.run(["srun", "-n", "2", "--time=2", sys.executable, str(SCRIPT)],
                          env=_env(slurm, tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=100)
    _check(proc, slurm)
    reports = _reports(tmp_path, 2)
    job = int(reports[0]["slurm_job_id"])
    for rank, r in enumerate(reports):
        assert (r["launcher"], r["rank"], r["size"], r["local_rank"], r["local_size"]) == (
            "slurm", rank, 2, rank, 2)
        assert (r["master_addr"], r["master_port"]) == (slurm.node, 15000 + job % 10000)
        assert (r["sum_rank_plus_1"], r["gathered_ranks"]) == (3.0, [0, 1])


def _sbatch_and_wait(cluster: SlurmCluster, args: list[str], env: dict[str, str], timeout: float) -> str:
    """Submit a batch job, wait until it left the queue and return its ``scontrol show job``
    line. Polls every 0.5 s (``sbatch --wait`` polls far less often, adding ~25 s)."""
    proc = subprocess.run(["sbatch", "--parsable", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    _check(proc, cluster)
    job = proc.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True,
                               text=True, timeout=30).stdout
        if any(f"JobState={s} " in state for s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                    "NODE_FAIL", "OUT_OF_MEMORY")):
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30, check=False)
    raise AssertionError(f"batch job {job} did not finish within {timeout}s\n{cluster.logs()}")


def _hvdrun() -> str:
    script = Path(sys.executable).with_name("hvdrun")
    if script.exists():
        return str(script)
    return f"{sys.executable} -c 'import sys; from hvd_trainer.launch.cli import main; sys.exit(main())'"


@pytest.mark.timeout(150)
def test_sbatch_script_with_hvdrun_and_with_srun(slurm: SlurmCluster, tmp_path: Path) -> None:
    batch = tmp_path / "job.sh"
    batch.write_text("\n".join([
        "#!/bin/bash",
        "#SBATCH --ntasks=2",
        "#SBATCH --time=3",
        "set -e",
        f"HVD_TEST_OUT={tmp_path / 'hvdrun'} {_hvdrun()} -np 2 {sys.executable} {SCRIPT}",
        f"HVD_TEST_OUT={tmp_path / 'srun'} srun {sys.executable} {SCRIPT}",
        f"HVD_TEST_OUT={tmp_path / 'plain'} {sys.executable} {SCRIPT}  # the script itself: 1 process",
        "",
    ]))
    log = tmp_path / "job.out"
    state = _sbatch_and_wait(slurm, ["--output", str(log), str(batch)], _env(slurm, tmp_path), timeout=120)
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, (
        f"{state}\n{log.read_text() if log.exists() else ''}\n{slurm.logs()}")
    under_hvdrun = _reports(tmp_path / "hvdrun", 2)
    assert [(r["launcher"], r["rank"], r["size"], r["local_rank"]) for r in under_hvdrun] == [
        ("torchrun", 0, 2, 0), ("torchrun", 1, 2, 1)]
    under_srun = _reports(tmp_path / "srun", 2)
    assert [(r["launcher"], r["rank"], r["size"], r["local_rank"]) for r in under_srun] == [
        ("slurm", 0, 2, 0), ("slurm", 1, 2, 1)]
    for r in under_hvdrun + under_srun:
        assert (r["sum_rank_plus_1"], r["gathered_ranks"]) == (3.0, [0, 1])
    assert [(r["launcher"], r["size"]) for r in _reports(tmp_path / "plain", 1)] == [("none", 1)]

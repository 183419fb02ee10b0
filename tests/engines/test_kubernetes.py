"""Kubeflow PyTorchJob: the environment the training operator gives each pod, on 2 "pods".

The operator sets, per pod: ``MASTER_ADDR``/``MASTER_PORT`` (the master pod's service),
``WORLD_SIZE`` = pods x ``PET_NPROC_PER_NODE``, ``RANK`` = ``PET_NODE_RANK`` = the *pod's*
index, ``PET_NNODES`` = pods, ``PET_NPROC_PER_NODE`` and ``PYTHONUNBUFFERED`` (kubeflow
training-operator, ``pkg/controller.v1/pytorch/envvar.go``). Here each "pod" is a process group
on this machine with exactly that environment, running the pod command the README documents.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_trainer.comm.base.launch_env import LaunchEnvError, from_pytorchjob, worker_launcher
from hvd_trainer.comm.world.world import detect_launch_env, free_port
from tests.e2e.hvdrun_helpers import ROOT, clean_env

SCRIPT = Path(__file__).parent / "scripts" / "report_world.py"
POD_COMMAND = [sys.executable, "-m", "torch.distributed.run", "--master-addr=$MASTER_ADDR",
               "--master-port=$MASTER_PORT", str(SCRIPT)]
"""``torchrun --master-addr=$MASTER_ADDR --master-port=$MASTER_PORT train.py`` (the README's pod
command; torchrun takes --nnodes/--nproc-per-node/--node-rank from the PET_* variables)."""


def pod_env(pod: int, pods: int, nproc: int, port: int) -> dict[str, str]:
    """What the training operator sets in pod ``pod`` (master = 0, workers = 1..) of a job."""
    return {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(pods * nproc),
        "RANK": str(pod), "PET_NODE_RANK": str(pod), "PET_NNODES": str(pods),
        "PET_NPROC_PER_NODE": str(nproc), "PYTHONUNBUFFERED": "0",
    }


def _run_pods(command: list[str], nproc: int, out: Path, timeout: float = 150) -> list[dict]:
    """Start 2 "pods" (each its own session, so all its processes can be killed), wait, and
    return every rank's report, in rank order."""
    port = free_port()
    procs = []
    try:
        for pod in range(2):
            env = clean_env(**pod_env(pod, 2, nproc, port), HVD_TEST_OUT=str(out), HVD_TEST_POD=str(pod))
            argv = [a.replace("$MASTER_ADDR", env["MASTER_ADDR"]).replace("$MASTER_PORT", env["MASTER_PORT"])
                    for a in command]  # what the pod's shell expands
            procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for pod, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"pod {pod} exited {p.returncode}:\n{text[-3000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2 * nproc)]


def test_the_pods_own_process_with_several_per_pod_is_refused_with_the_pod_command() -> None:
    env = pod_env(pod=1, pods=2, nproc=2, port=23456)
    with pytest.raises(LaunchEnvError, match=r"RANK there is the pod's index.*HINT: make the pod's "
                                             r"command `torchrun --master-addr=\$MASTER_ADDR"):
        detect_launch_env(env)
    with pytest.raises(LaunchEnvError, match="PET_NNODES='1:4'"):  # elastic policy: a range
        detect_launch_env({**pod_env(0, 2, 1, 23456), "PET_NNODES": "1:4"})
    assert worker_launcher(env) is None  # hvdrun/torchrun may start inside the pod


def test_one_process_per_pod_reads_the_pod_rank() -> None:
    info = detect_launch_env(pod_env(pod=1, pods=2, nproc=1, port=23456))
    assert (info.rank, info.size, info.local_rank, info.local_size) == (1, 2, 0, 1)
    assert (info.launcher, info.master_addr, info.master_port) == ("pytorchjob", "127.0.0.1", 23456)


def test_a_torchrun_worker_inside_the_pod_reads_torchruns_variables() -> None:
    # What torchrun exports to its 2nd worker in pod 1 (it overrides RANK/WORLD_SIZE).
    env = {**pod_env(pod=1, pods=2, nproc=2, port=23456), "RANK": "3", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "none"}
    assert from_pytorchjob(env) is None
    info = detect_launch_env(env)
    assert (info.rank, info.size, info.local_rank, info.local_size, info.launcher) == (3, 4, 1, 2, "torchrun")


@pytest.mark.timeout(200)
def test_two_pods_of_two_processes_through_torchrun_get_process_ranks(tmp_path: Path) -> None:
    reports = _run_pods(POD_COMMAND, nproc=2, out=tmp_path)
    for rank, r in enumerate(reports):
        pod = int(r["pod"])
        assert (r["rank"], r["size"], r["local_size"], r["cross_size"]) == (rank, 4, 2, 2)
        assert (r["local_rank"], r["cross_rank"]) == (rank - 2 * pod, pod)  # pod p holds 2p, 2p+1
        assert r["launcher"] == "torchrun"
        assert r["sum_rank_plus_1"] == 10.0  # 1 + 2 + 3 + 4 over all 4 processes
        assert r["gathered_ranks"] == [0, 1, 2, 3]


@pytest.mark.timeout(200)
def test_two_pods_of_one_process_run_the_script_directly(tmp_path: Path) -> None:
    reports = _run_pods([sys.executable, str(SCRIPT)], nproc=1, out=tmp_path)
    assert [(r["rank"], r["pod"], r["launcher"]) for r in reports] == [(0, "0", "pytorchjob"),
                                                                        (1, "1", "pytorchjob")]
    assert [r["sum_rank_plus_1"] for r in reports] == [3.0, 3.0]
    assert all(r["gathered_ranks"] == [0, 1] for r in reports)

"""detect_launch_env: torchrun, Open MPI, MPICH, Slurm and plain runs, from given environments."""

from __future__ import annotations

import pytest

from hvd_trainer.comm.base import launch_env
from hvd_trainer.comm.base.launch_env import (
    LaunchEnv,
    LaunchEnvError,
    TorchElasticEnv,
    expand_nodelist,
    launcher_rank,
    lightning_script_view,
    torchelastic_env,
    worker_launcher,
)
from hvd_trainer.comm.world.world import detect_launch_env

CASES = [
    ("plain", {}, LaunchEnv(rank=0, size=1, local_rank=0, local_size=1)),
    (
        "torchrun",
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
         "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "OMPI_COMM_WORLD_RANK": "0"},
        LaunchEnv(rank=3, size=4, local_rank=1, local_size=2, master_addr="10.0.0.1",
                  master_port=29500, launcher="torchrun"),
    ),
    (
        "openmpi-exported-master",
        {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
         "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
         "MASTER_ADDR": "h1", "MASTER_PORT": "1234", "SLURM_PROCID": "7", "SLURM_NTASKS": "8"},
        LaunchEnv(rank=1, size=4, local_rank=1, local_size=2, master_addr="h1",
                  master_port=1234, launcher="mpi"),
    ),
    (
        "openmpi-single-node-derived-port",
        {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
         "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
         "OMPI_MCA_ess_base_jobid": "12345"},
        LaunchEnv(rank=0, size=2, local_rank=0, local_size=2, master_addr="127.0.0.1",
                  master_port=launch_env._derived_port("12345"), launcher="mpi"),
    ),
    (
        "mpich",
        {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3",
         "MASTER_ADDR": "a", "MASTER_PORT": "5"},
        LaunchEnv(rank=2, size=3, local_rank=2, local_size=3, master_addr="a", master_port=5,
                  launcher="mpi"),
    ),
    (
        "mpi-size-one",
        {"PMI_RANK": "0", "PMI_SIZE": "1"},
        LaunchEnv(rank=0, size=1, local_rank=0, local_size=1, launcher="mpi"),
    ),
    (
        "slurm-nodelist",
        {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]",
         "SLURM_JOB_ID": "123456"},
        LaunchEnv(rank=5, size=8, local_rank=1, local_size=4, master_addr="gpu07",
                  master_port=15000 + 123456 % 10000, launcher="slurm"),
    ),
    (
        "slurm-uneven-tasks",
        {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
         "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_NODELIST": "n1,n2,n3", "MASTER_PORT": "99"},
        LaunchEnv(rank=4, size=5, local_rank=0, local_size=1, master_addr="n1",
                  master_port=99, launcher="slurm"),
    ),
    (
        "slurm-interactive-shell-is-not-a-launch",
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NAME": "bash"},
        LaunchEnv(rank=0, size=1, local_rank=0, local_size=1),
    ),
]


@pytest.mark.parametrize(("env", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_detect_launch_env(env: dict[str, str], expected: LaunchEnv, monkeypatch) -> None:
    monkeypatch.setenv("PATH", "")  # no scontrol: the nodelist parser is what runs
    monkeypatch.setattr(launch_env, "_mpi4py_rendezvous", lambda: None)  # as without libmpi
    assert detect_launch_env(env) == expected


def test_mpi_on_several_nodes_uses_mpi4py_rendezvous(monkeypatch) -> None:
    # What rank 0 broadcasts over MPI (its host name and a free port) becomes the master.
    monkeypatch.setattr(launch_env, "_mpi4py_rendezvous", lambda: ("node7", 4321))
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert detect_launch_env(env) == LaunchEnv(rank=3, size=4, local_rank=1, local_size=2,
                                               master_addr="node7", master_port=4321, launcher="mpi")


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank=2"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "incomplete"),
        # several nodes, no MASTER_ADDR, no usable mpi4py (no libmpi on this machine)
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
          "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "HINT"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-"}, "unbalanced"),
    ],
)
def test_detect_launch_env_errors(env: dict[str, str], needle: str, monkeypatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(launch_env, "_mpi4py_rendezvous", lambda: None)
    with pytest.raises(ValueError, match=needle):
        detect_launch_env(env)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
        ("a[9-11]", ["a9", "a10", "a11"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


def test_expand_nodelist_bad_range() -> None:
    with pytest.raises(LaunchEnvError, match="x-y"):
        expand_nodelist("n[x-y]")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"TORCHELASTIC_RUN_ID": "abc"}, "torchrun"),
        ({"RANK": "0", "WORLD_SIZE": "1"}, "torchrun"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "mpi"),
        ({"PMI_RANK": "0"}, "mpi"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, "slurm"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}, None),
    ],
)
def test_worker_launcher(env: dict[str, str], expected: str | None) -> None:
    assert worker_launcher(env) == expected


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({}, 0),
        ({"RANK": "3", "WORLD_SIZE": "4"}, 3),
        ({"RANK": "3"}, 0),  # no WORLD_SIZE: not torchrun (as detect_launch_env)
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}, 2),
        ({"PMI_RANK": "1", "PMI_SIZE": "2"}, 1),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, 5),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_JOB_NAME": "bash"}, 0),  # salloc shell
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, 1),  # Lightning's self-launch
        ({"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, 0),  # torchrun first
    ],
)
def test_launcher_rank_without_rendezvous(env: dict[str, str], rank: int, monkeypatch) -> None:
    def no_rendezvous():
        raise AssertionError("launcher_rank must not rendezvous")

    monkeypatch.setattr(launch_env, "_mpi4py_rendezvous", no_rendezvous)
    assert launcher_rank(env) == rank


def test_launcher_rank_agrees_with_detect_launch_env(monkeypatch) -> None:
    monkeypatch.setattr(launch_env, "_mpi4py_rendezvous", lambda: None)
    for env in ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "h",
                 "MASTER_PORT": "1"},
                {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
                {"RANK": "1", "WORLD_SIZE": "2"}):
        assert launcher_rank(env) == detect_launch_env(env).rank == 1


def test_lightning_script_view_does_not_modify_the_environment() -> None:
    env = {"LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29600"}
    view = lightning_script_view(env)
    assert view == {**env, "RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert "RANK" not in env
    assert detect_launch_env(view) == LaunchEnv(rank=1, size=2, local_rank=1, local_size=2,
                                                master_port=29600, launcher="torchrun")
    assert lightning_script_view({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}) is None
    assert lightning_script_view({"LOCAL_RANK": "0"}) is None


def test_torchelastic_env() -> None:
    assert torchelastic_env({}) == TorchElasticEnv()
    assert not TorchElasticEnv().unique_run_id
    got = torchelastic_env({"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_MAX_RESTARTS": "3",
                            "TORCHELASTIC_RESTART_COUNT": "1"})
    assert got == TorchElasticEnv(under_agent=True, max_restarts=3, restart_count=1, run_id="job7")
    assert got.unique_run_id
    static = torchelastic_env({"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_MAX_RESTARTS": ""})
    assert static.under_agent and not static.unique_run_id and static.max_restarts == 0
    with pytest.raises(LaunchEnvError, match="TORCHELASTIC_RESTART_COUNT='x'.*HINT"):
        torchelastic_env({"TORCHELASTIC_RESTART_COUNT": "x"})


def test_horovodrun_variables_alone() -> None:
    from hvd_trainer.comm.base.launch_env import LaunchEnvError, from_horovod, launcher_rank
    from hvd_trainer.comm.world.world import detect_launch_env

    env = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
           "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "2",
           "HOROVOD_HOSTNAME": "h1", "MASTER_ADDR": "h0", "MASTER_PORT": "29511"}
    info = detect_launch_env(env)
    assert (info.rank, info.size, info.local_rank, info.local_size) == (1, 4, 1, 2)
    assert (info.cross_rank, info.cross_size, info.launcher) == (0, 2, "horovodrun")
    assert (info.master_addr, info.master_port) == ("h0", 29511)
    assert launcher_rank(env) == 1
    # one host, horovodrun's (HTTP) rendezvous only: loopback and a port all ranks derive alike
    single = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0",
              "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
              "HOROVOD_GLOO_RENDEZVOUS_PORT": "4321"}
    a, b = from_horovod(single), from_horovod({**single, "HOROVOD_RANK": "1", "HOROVOD_LOCAL_RANK": "1"})
    assert a.master_addr == b.master_addr == "127.0.0.1" and a.master_port == b.master_port
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR"):  # several hosts need MASTER_*
        from_horovod({k: v for k, v in env.items() if not k.startswith("MASTER")})
    # torchrun's variables win when both are present (hvdrun exports both)
    both = {**env, "RANK": "3", "WORLD_SIZE": "4"}
    assert detect_launch_env(both).rank == 3 and detect_launch_env(both).launcher == "torchrun"

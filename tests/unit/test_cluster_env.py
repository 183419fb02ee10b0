"""HorovodEnvironment: ranks come from comm.detect_launch_env; Lightning's self-launch variables
are translated to torchrun's."""

from __future__ import annotations

import pytest

from hvd_trainer.lightning.cluster_env import (
    HorovodEnvironment,
    SelfLaunchError,
    UnevenHostsError,
    launch_devices,
)

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "NODE_RANK", "GROUP_RANK")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCH_VARS:
        # set, then delete: monkeypatch then restores the original state, even for variables
        # a test (or Lightning's launcher) writes
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)


def test_no_launcher_is_a_world_of_one() -> None:
    env = HorovodEnvironment()
    assert (env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()) == (0, 1, 0, 0)
    assert env.creates_processes_externally is False
    assert env.main_address == "127.0.0.1"
    assert env.main_port == env.main_port > 0  # a free port, chosen once


def test_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4",
                     MASTER_ADDR="10.0.0.2", MASTER_PORT="29511").items():
        monkeypatch.setenv(k, v)
    env = HorovodEnvironment()
    assert (env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()) == (5, 8, 1, 1)
    assert env.creates_processes_externally is True
    assert (env.main_address, env.main_port) == ("10.0.0.2", 29511)
    env.set_global_rank(0)  # the launcher decides: setters do not override it
    env.set_world_size(1)
    assert (env.global_rank(), env.world_size()) == (5, 8)


def test_lightning_self_launch_variables_are_translated(monkeypatch: pytest.MonkeyPatch) -> None:
    # what Lightning's script launcher exports to the process it starts for local rank 1
    for k, v in dict(LOCAL_RANK="1", WORLD_SIZE="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29600").items():
        monkeypatch.setenv(k, v)
    env = HorovodEnvironment()
    assert (env.global_rank(), env.world_size(), env.local_rank()) == (1, 2, 1)
    assert env.creates_processes_externally is True
    import os

    # the torchrun view is handed to comm, not written into the process environment
    assert env.environ()["RANK"] == "1" and env.environ()["LOCAL_WORLD_SIZE"] == "2"
    assert env.launch_env().local_size == 2
    assert "RANK" not in os.environ and "LOCAL_WORLD_SIZE" not in os.environ


def test_multi_node_self_launch_is_refused() -> None:
    env = HorovodEnvironment()
    env.validate_settings(num_devices=2, num_nodes=1)
    with pytest.raises(SelfLaunchError, match="num_nodes=2.*HINT"):
        env.validate_settings(num_devices=2, num_nodes=2)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ("auto", 1)),  # nothing launched it: Lightning decides
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, ("auto", 1)),
        # hvdrun/torchrun -np 2 on one host, then on 2 hosts of 1 and 3 hosts of 2
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (2, 1)),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, (1, 2)),
        ({"RANK": "4", "WORLD_SIZE": "6", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, (2, 3)),
        # mpirun, and Lightning's own self-launch (LOCAL_RANK and WORLD_SIZE, one node)
        ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h1", "MASTER_PORT": "29500"}, (2, 2)),
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, (2, 1)),
    ],
)
def test_launch_devices_multiply_to_the_world_size(env: dict[str, str], expected: tuple,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert launch_devices() == expected


def test_launch_devices_refuses_uneven_hosts() -> None:
    # -H a:3,b:1: the host with 3 of 4 processes
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"}
    with pytest.raises(UnevenHostsError, match=r"3 of the job's 4 processes.*HINT: give every host the same"):
        launch_devices(env)

"""hvdrun's ssh launch, without a network: the printed ssh commands, what travels, what is noted."""

from __future__ import annotations

import json
import shlex
import socket

import pytest

from hvd_trainer.launch import cli
from hvd_trainer.launch.agent_identity import identify
from hvd_trainer.launch.errors import HvdrunError
from hvd_trainer.launch.hosts import HostSlots
from hvd_trainer.launch.options import parse_options
from hvd_trainer.launch.ssh import carried_env, env_line, remote_argv
from hvd_trainer.launch.this_host import interface_address, is_this_host

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


@pytest.fixture(autouse=True)
def _plain_shell(monkeypatch) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def _dry(argv: list[str], capsys) -> tuple[list[str], str]:
    assert cli.main(["--dry-run", *argv]) == 0
    captured = capsys.readouterr()
    return captured.out.strip().splitlines(), captured.err


def test_dry_run_prints_one_ssh_command_per_other_host(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOROVOD_SECRETISH", "do-not-print-me")
    lines, err = _dry(["-np", "6", "-H", "nodeA:2,nodeB:2,nodeC:2", "-p", "2222", "-i", "/k/id",
                       "--ssh-option", "UserKnownHostsFile=/k/kh", "python", "train.py", "--lr", "1"], capsys)
    ssh = [shlex.split(line) for line in lines if line.startswith("ssh ")]
    assert [cmd[-2] for cmd in ssh] == ["nodeA", "nodeB", "nodeC"]
    ids = set()
    for cmd in ssh:
        assert cmd[:5] == ["ssh", "-p", "2222", "-i", "/k/id"]
        assert "UserKnownHostsFile=/k/kh" in cmd and "BatchMode=yes" in cmd
        remote = shlex.split(cmd[-1].replace("&&", ";"))
        assert remote[:3] == ["cd", str(tmp_path), ";"]
        assert "hvd_trainer.launch.ssh_child" in remote
        tail = remote[remote.index("hvd_trainer.launch.ssh_child") + 1:]
        assert tail[:2] == ["--this-host", cmd[-2]] and "--dry-run" not in tail
        assert tail[-4:] == ["python", "train.py", "--lr", "1"]
        ids.add(tail[tail.index("--rdzv-id") + 1])
    (rdzv,) = ids  # one fresh id for the job, the same on every host
    assert rdzv.startswith("hvdrun-")
    agents = [line for line in lines if line.startswith("# node")]
    assert [a.split()[1] for a in agents] == ["nodeA", "nodeB", "nodeC"]
    assert all(f"--rdzv-id={rdzv}" in a for a in agents)
    assert "is_host=true" in agents[0] and all("is_host=false" in a for a in agents[1:])
    assert "--local-addr=nodeB" in agents[1]
    assert "do-not-print-me" not in "\n".join(lines) + err
    assert "note: --ssh-port" not in err and "note: --ssh-identity-file" not in err


def test_this_host_in_the_list_runs_without_ssh(capsys) -> None:
    me = socket.gethostname()
    lines, _ = _dry(["-np", "4", "-H", f"{me}:2,elsewhere:2", "x.py"], capsys)
    ssh = [line for line in lines if line.startswith("ssh ")]
    assert len(ssh) == 1 and shlex.split(ssh[0])[-2] == "elsewhere"
    local = [line for line in lines if "torch.distributed.run" in line and not line.startswith("#")]
    assert len(local) == 1 and "is_host=true" in local[0] and f"--rdzv-endpoint={me}:29400" in local[0]


def test_same_line_mode_starts_nothing_over_ssh(capsys) -> None:
    me = socket.gethostname()
    lines, err = _dry(["-np", "4", "-H", f"10.255.255.1:2,{me}:2", "--no-ssh", "-p", "22", "x.py"], capsys)
    assert not [line for line in lines if line.startswith("ssh ")]
    assert "is_host=false" in lines[-1] and f"--local-addr={me}" in lines[-1]
    assert "note: --ssh-port: ignored without --mpi or other hosts" in err


def test_localhost_first_with_other_hosts_is_an_error(capsys) -> None:
    assert cli.main(["-np", "4", "-H", "localhost:2,b:2", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "other hosts cannot reach 'localhost'" in err and "HINT" in err


def test_same_line_on_a_machine_not_in_the_list_is_one_line(capsys) -> None:
    assert cli.main(["-np", "4", "-H", "hvd-no-such-a:2,hvd-no-such-b:2", "--no-ssh", "x.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is none of the hosts hvd-no-such-a,hvd-no-such-b" in err


def test_elastic_same_line_on_an_unlisted_machine_joins_without_hosting(capsys) -> None:
    lines, _ = _dry(["-np", "2", "-H", "10.255.255.1:1,10.255.255.2:1", "--no-ssh", "--min-np", "1",
                     "--max-np", "3", "x.py"], capsys)
    assert "is_host=false" in lines[-1] and f"--local-addr={socket.gethostname()}" in lines[-1]


def test_first_host_by_hostname_only_is_named_with_the_fix(monkeypatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "hvd-unresolvable-name")
    hosts = [HostSlots("hvd-unresolvable-name", 2), HostSlots("b", 2)]
    with pytest.raises(HvdrunError, match="does not resolve here, which is no address of this") as err:
        identify(hosts, None, None)
    assert "HINT: put this machine's address first in -H" in str(err.value)


def test_carried_environment_and_its_line() -> None:
    env = {"PATH": "/bin", "PYTHONPATH": "/src", "HOROVOD_X": "1", "NCCL_DEBUG": "INFO",
           "GLOO_SOCKET_IFNAME": "e", "HOME": "/root", "SSH_AUTH_SOCK": "/tmp/a", "HVDRUN_JOB_DIR": "/tmp/j",
           "RANDOM_THING": "x"}
    got = carried_env(env)
    assert got == {"PATH": "/bin", "PYTHONPATH": "/src", "HOROVOD_X": "1", "NCCL_DEBUG": "INFO",
                   "GLOO_SOCKET_IFNAME": "e"}
    assert json.loads(env_line(got)) == {"env": got} and env_line(got).endswith(b"\n")


def test_remote_argv_keeps_the_command_intact() -> None:
    opts, _ = parse_options(["--dry-run", "-np", "2", "-H", "a:1,b:1", "--", "python", "t.py", "--dry-run"])
    assert remote_argv(opts, opts.hosts[1]) == ["--this-host", "b", "-np", "2", "-H", "a:1,b:1", "--",
                                                "python", "t.py", "--dry-run"]


def test_this_host_and_interfaces() -> None:
    assert is_this_host("localhost") and is_this_host(socket.gethostname())
    assert not is_this_host("hvd-no-such-host.invalid")
    assert interface_address("lo") == "127.0.0.1"
    with pytest.raises(HvdrunError, match="no interface 'nope0'.*it has: .*lo"):
        interface_address("nope0")

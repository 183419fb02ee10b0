"""hvdrun argument checks and the commands it builds (--dry-run), in process, as tables."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from hvd_trainer.launch import cli
from hvd_trainer.launch.commands import WORKER_ENTRY
from hvd_trainer.launch.hosts import HostSlots, parse_hosts, read_hostfile

PY = sys.executable
RUN = f"{PY} {WORKER_ENTRY} {PY}"
"""Every rank's command starts with the worker entry (HOROVOD_* variables, prefixed lines)."""

# name, argv, substrings that must appear in the printed command (stdout)
DRY_RUNS = [
    ("single-host", ["-np", "2", "train.py", "--lr", "1"],
     ["-m torch.distributed.run", "--nproc-per-node=2", "--nnodes=1", "--master-addr=127.0.0.1",
      "--rdzv-conf=timeout=30", "--max-restarts=0", f"--no-python {RUN} train.py --lr 1"]),
    ("single-host-listens-on-loopback", ["-np", "2", "x.py"],
     ["GLOO_SOCKET_IFNAME=lo", "NCCL_SOCKET_IFNAME=lo"]),
    ("python-word-uses-our-interpreter", ["-np", "1", "--", "python", "-c", "pass"],
     [f"--no-python {RUN} -c pass"]),
    ("worker-env", ["-np", "1", "--fusion-threshold-mb", "1.5", "--cycle-time-ms", "5",
                    "--timeline-filename", "/tmp/t.json", "--network-interface", "eth1", "x.py"],
     ["HOROVOD_FUSION_THRESHOLD=1572864", "HOROVOD_CYCLE_TIME=5", "HOROVOD_TIMELINE=/tmp/t.json",
      "GLOO_SOCKET_IFNAME=eth1", "NCCL_SOCKET_IFNAME=eth1"]),
    ("start-timeout-and-logs", ["-np", "2", "--start-timeout", "7", "--output-filename", "/tmp/o", "x.py"],
     ["--rdzv-conf=timeout=7", "HVDRUN_OUTPUT_DIR=/tmp/o"]),
    ("multi-host-c10d", ["-np", "4", "-H", "h1:2,h2:2", "--port", "1234", "--rdzv-id", "job7", "x.py"],
     ["--nproc-per-node=2", "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=h1:1234",
      "--rdzv-id=job7", "--rdzv-conf=join_timeout=30"]),
    ("multi-host-default-port", ["-np", "4", "-H", "h1:2,h2:2", "x.py"], ["--rdzv-endpoint=h1:29400"]),
    ("elastic-single-host", ["-np", "2", "--min-np", "2", "--max-np", "2", "--recovery", "restart", "x.py"],
     ["--nnodes=1:1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:", "--local-addr=127.0.0.1",
      "join_timeout=30,rejoin_timeout=600",
      "--max-restarts=3", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]),
    ("elastic-multi-host", ["-np", "4", "-H", "a:2,b:2,c:2", "--min-np", "2", "--max-np", "6",
                            "--max-restarts", "5", "--recovery", "restart", "x.py"],
     ["--nnodes=1:3", "--max-restarts=5"]),
    ("elastic-whole-hosts-in-process", ["-np", "4", "-H", "a:2,b:2,c:2", "--min-np", "4", "--max-np", "4",
                                        "x.py"],
     ["HVDRUN_RECOVERY=in-process", "--nnodes=2:2", "--max-restarts=0", ",in_process=true"]),
    ("mpirun", ["--mpi", "-np", "4", "-H", "h1:2,h2:2", "--fusion-threshold-mb", "1", "x.py"],
     ["-np 4 -H h1:2,h2:2 --bind-to none --map-by slot", "-x MASTER_ADDR=h1",
      "-x MASTER_PORT=29400", "-x HOROVOD_FUSION_THRESHOLD=1048576", f"{RUN} x.py"]),
    ("cpu-hides-gpus", ["-np", "1", "--device", "cpu", "x.py"], ["CUDA_VISIBLE_DEVICES=''"]),
    ("elastic-by-process-recovers-in-process", ["-np", "2", "--min-np", "1", "--max-np", "2", "x.py"],
     ["HVDRUN_RECOVERY=in-process", "HVDRUN_MIN_NP=1", "--nnodes=1", "--max-restarts=0"]),
    ("elastic-by-process-across-hosts", ["-np", "4", "-H", "a:2,b:2", "--min-np", "3", "x.py"],
     ["HVDRUN_RECOVERY=in-process", "--nnodes=2:2", "--max-restarts=0", ",in_process=true"]),
]


@pytest.mark.parametrize(("argv", "expected"), [d[1:] for d in DRY_RUNS], ids=[d[0] for d in DRY_RUNS])
def test_dry_run_command(argv: list[str], expected: list[str], capsys, monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["--dry-run", *argv]) == 0
    out = capsys.readouterr().out.strip()
    for needle in expected:
        assert needle in out, f"{needle!r} not in {out}"
    shlex.split(out)  # a valid shell line


# name, argv, extra environment, substring of the error message
ERRORS = [
    ("unknown-flag", ["-np", "2", "--bogus", "x.py"], {}, "unrecognized arguments: --bogus"),
    ("np-zero", ["-np", "0", "x.py"], {}, "-np must be >= 1, got 0"),
    ("np-missing", ["x.py"], {}, "-np/--num-proc is required"),
    ("no-command", ["-np", "2"], {}, "no command given"),
    ("np-over-slots", ["-np", "5", "-H", "a:2,b:2", "x.py"], {}, "more than the 4 slot(s)"),
    ("uneven-hosts", ["-np", "3", "-H", "a:2,b:2", "x.py"], {}, "different process counts per host"),
    ("bad-slots", ["-np", "2", "-H", "a:x", "x.py"], {}, "bad slot count"),
    ("hosts-and-hostfile", ["-np", "2", "-H", "a:2", "--hostfile", "f", "x.py"], {}, "not both"),
    ("elastic-order", ["-np", "2", "--min-np", "3", "x.py"], {}, "min=3 np=2"),
    ("elastic-restart-not-whole-hosts", ["-np", "4", "-H", "a:2,b:2", "--min-np", "3", "--recovery",
                                         "restart", "x.py"], {},
     "not multiples of the 2 process(es) per host"),
    # in process: ranks come and go singly, hosts whole; a host past --max-np would have rankless workers
    ("elastic-in-process-max-np-not-whole-hosts", ["-np", "2", "-H", "a:2,b:2", "--min-np", "1", "--max-np",
                                                   "3", "x.py"], {},
     "--max-np 3 is not a multiple of the 2 processes per host"),
    ("cuda-without-gpu", ["-np", "1", "--device", "cuda", "x.py"], {}, "--device cuda was requested"),
    ("bad-timeout", ["-np", "1", "--start-timeout", "0", "x.py"], {}, "--start-timeout must be > 0"),
    ("inside-torchrun-worker", ["-np", "2", "x.py"], {"TORCHELASTIC_RUN_ID": "x"},
     "already launched by torchrun"),
    ("inside-mpi-worker", ["-np", "2", "x.py"], {"OMPI_COMM_WORLD_RANK": "0"}, "already launched by mpi"),
]


@pytest.mark.parametrize(("argv", "env", "needle"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors_before_anything_starts(argv, env, needle, capsys, monkeypatch) -> None:
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hvdrun: error: ") and needle in err, err


def test_mpi_without_mpirun_is_an_error(capsys, monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert cli.main(["--mpi", "-np", "2", "x.py"]) == 2
    assert "--mpi needs mpirun on PATH" in capsys.readouterr().err


def test_hosts_and_hostfile(tmp_path: Path) -> None:
    assert parse_hosts("h1:2, h2") == [HostSlots(host="h1", slots=2), HostSlots(host="h2", slots=1)]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=4\n\nnode2 slots = 4  # gpu box\nnode3\n")
    assert read_hostfile(hostfile) == [HostSlots(host="node1", slots=4), HostSlots(host="node2", slots=4),
                                       HostSlots(host="node3", slots=1)]
    hostfile.write_text("node1 cpus=4\n")
    with pytest.raises(ValueError, match="line 1"):
        read_hostfile(hostfile)


def test_check_build_lists_frameworks_and_transports(capsys) -> None:
    import torch

    assert cli.main(["--check-build"]) == 0
    out = capsys.readouterr().out
    assert f"PyTorch {torch.__version__}" in out
    for needle in ("CUDA (", "gloo", "NCCL", "MPI launcher", "mpi4py", "Keras"):
        assert needle in out, out


@pytest.mark.parametrize(("argv", "size", "multi"), [
    (["-np", "3", "x.py", "--nnodes=4", "--nproc-per-node=9"], 3, False),  # the script's own flags
    (["-np", "2", "--max-restarts", "2", "x.py"], 2, False),
    (["-np", "4", "-H", "a:2,b:2", "x.py"], None, True),  # several hosts: this agent sees only its own
])
def test_single_host_world_size(argv: list[str], size: int | None, multi: bool) -> None:
    """hvdrun can name the ranks that ended with status 0 (torchrun lists only failures) when the
    whole job ran under one agent; over several hosts it sends the user to the other hosts."""
    from hvd_trainer.launch.commands import torchrun_args
    from hvd_trainer.launch.options import parse_options
    from hvd_trainer.launch.runner import _multi_host, _single_host_world_size

    opts, _ = parse_options(argv)
    assert _single_host_world_size(torchrun_args(opts, 29400)) == size
    assert _multi_host(torchrun_args(opts, 29400)) is multi


def test_early_exit_note_counts_ranks_the_agent_sigtermed_as_victims() -> None:
    """Rank 1 exits 0 early; rank 0 raises RankFailedError (75) and the agent SIGTERMs rank 2,
    still waiting: the note still names rank 1, the cause (a helper's finding)."""
    import signal
    from types import SimpleNamespace

    from hvd_trainer.launch.runner import _early_exit_note

    peer, term = SimpleNamespace(exitcode=75), SimpleNamespace(exitcode=-signal.SIGTERM)
    note = _early_exit_note({0: peer, 2: term}, 0, 3)
    assert "rank 1 had already ended with exit code 0" in note
    assert _early_exit_note({0: term, 2: term}, 0, 3) == ""  # nobody reported a lost peer
    assert _early_exit_note({0: peer, 2: SimpleNamespace(exitcode=1)}, 0, 3) == ""  # rank 2 failed
    assert "on another host" in _early_exit_note({0: peer, 1: term}, 0, None, multi_host=True)


def test_elastic_jobs_recover_in_process_unless_told_to_restart(capsys, monkeypatch) -> None:
    """Horovod's elastic mode kept the survivors' processes; so does every elastic hvdrun job, by
    process or by whole hosts, unless ``--recovery restart`` asks for torchrun's restart path."""
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    for lo, hi in (("1", "2"), ("2", "2")):
        assert cli.main(["--dry-run", "-np", "2", "--min-np", lo, "--max-np", hi, "x.py"]) == 0
        assert "HVDRUN_RECOVERY=in-process" in capsys.readouterr().out, (lo, hi)
    assert cli.main(["--dry-run", "-np", "2", "--min-np", "2", "--max-np", "2", "--recovery", "restart",
                     "x.py"]) == 0
    assert "HVDRUN_RECOVERY" not in capsys.readouterr().out
    assert cli.main(["--dry-run", "-np", "2", "x.py"]) == 0  # not elastic: no recovery at all
    assert "HVDRUN_RECOVERY" not in capsys.readouterr().out

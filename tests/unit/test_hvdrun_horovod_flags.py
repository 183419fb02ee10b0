"""Every horovodrun flag under hvdrun: honoured (seen in the command) or noted (one line why).

Also the worker entry's HOROVOD_* variables and line prefix, the user-error classification
elastic restarts rely on, and --check-build's MPI launcher line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from hvd_trainer.comm.base.errors import CollectiveMismatchError, RankFailedError, StallError
from hvd_trainer.elastic.user_error import is_peer_failure, record_user_error, user_error_path
from hvd_trainer.launch import cli
from hvd_trainer.launch.agent_watch import read_user_errors, watch_supported
from hvd_trainer.launch.worker_entry import horovod_env, prefix

# horovodrun's flags (runner/launch.py parse_args) -> where the effect shows: "out" (the printed
# command), "err" (a note on stderr); and the text expected there.
FLAGS = [
    (["--version"], "out", "hvdrun (hvd_trainer)"),
    (["-v"], "out", "hvdrun (hvd_trainer)"),
    (["--gloo"], "err", "note: --gloo: torchrun with gloo"),
    (["--jsrun"], "err", "note: --jsrun: hvdrun does not launch through jsrun"),
    (["--disable-cache"], "err", "note: --disable-cache:"),
    (["--start-timeout", "9"], "out", "--rdzv-conf=timeout=9"),
    (["--network-interfaces", "eth2"], "out", "GLOO_SOCKET_IFNAME=eth2"),
    (["--network-interface", "eth3"], "out", "NCCL_SOCKET_IFNAME=eth3"),
    (["--output-filename", "/tmp/logs"], "out", "HVDRUN_OUTPUT_DIR=/tmp/logs"),
    (["--verbose"], "out", "torch.distributed.run"),
    (["--config-file", "c.yaml"], "err", "note: --config-file: hvdrun does not read"),
    (["-p", "2222"], "err", "note: --ssh-port: ignored without --mpi"),
    (["--ssh-port", "2222"], "err", "note: --ssh-port:"),
    (["-i", "key"], "err", "note: --ssh-identity-file:"),
    (["--fusion-threshold-mb", "4"], "out", "HOROVOD_FUSION_THRESHOLD=4194304"),
    (["--cycle-time-ms", "2"], "out", "HOROVOD_CYCLE_TIME=2"),
    (["--cache-capacity", "512"], "err", "note: --cache-capacity:"),
    (["--hierarchical-allreduce"], "err", "note: --hierarchical-allreduce:"),
    (["--no-hierarchical-allreduce"], "err", "note: --hierarchical-allreduce:"),
    (["--hierarchical-allgather"], "err", "note: --hierarchical-allgather:"),
    (["--no-hierarchical-allgather"], "err", "note: --hierarchical-allgather:"),
    (["--torus-allreduce"], "err", "note: --torus-allreduce:"),
    (["--no-torus-allreduce"], "err", "note: --torus-allreduce:"),
    (["--autotune"], "out", "HOROVOD_AUTOTUNE=1"),
    (["--autotune-log-file", "a.csv"], "out", "HOROVOD_AUTOTUNE_LOG=a.csv"),
    (["--autotune-warmup-samples", "3"], "out", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES=3"),
    (["--autotune-steps-per-sample", "10"], "out", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE=10"),
    (["--autotune-bayes-opt-max-samples", "20"], "out", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES=20"),
    (["--autotune-gaussian-process-noise", "0.8"], "err", "note: --autotune-gaussian-process-noise:"),
    (["--min-np", "1"], "out", "HVDRUN_MIN_NP=1"),
    (["--min-num-proc", "1"], "out", "HVDRUN_MIN_NP=1"),
    (["--max-np", "1"], "out", "HVDRUN_MAX_NP=1"),
    (["--max-num-proc", "1"], "out", "HVDRUN_MAX_NP=1"),
    (["--slots-per-host", "2"], "err", "note: --slots-per-host:"),
    (["--min-np", "1", "--elastic-timeout", "44"], "out", "--rdzv-conf=join_timeout=44"),
    (["--reset-limit", "5"], "out", "--max-restarts=5"),
    (["--blacklist-cooldown-range", "10", "100"], "err", "note: --blacklist-cooldown-range:"),
    (["--timeline-filename", "/tmp/tl.json"], "out", "HOROVOD_TIMELINE=/tmp/tl.json"),
    (["--timeline-mark-cycles"], "err", "note: --timeline-mark-cycles:"),
    (["--no-stall-check"], "out", "HOROVOD_STALL_CHECK_DISABLE=1"),
    (["--stall-check-warning-time-seconds", "30"], "out", "HOROVOD_STALL_CHECK_TIME_SECONDS=30"),
    (["--stall-check-shutdown-time-seconds", "90"], "out", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=90"),
    (["--mpi-threads-disable"], "err", "note: --mpi-threads-disable:"),
    (["--mpi-args=--mca a b"], "err", "note: --mpi-args: ignored without --mpi"),
    (["--tcp"], "err", "note: --tcp: ignored without --mpi"),
    (["--binding-args=--bind-to core"], "err", "note: --binding-args:"),
    (["--num-nccl-streams", "2"], "err", "note: --num-nccl-streams:"),
    (["--thread-affinity", "1"], "err", "note: --thread-affinity:"),
    (["--gloo-timeout-seconds", "60"], "out", "HOROVOD_GLOO_TIMEOUT_SECONDS=60"),
    (["--log-level", "DEBUG"], "out", "HOROVOD_LOG_LEVEL=DEBUG"),
    (["--log-without-timestamp"], "err", "note: --log-without-timestamp:"),
    (["--log-hide-timestamp"], "err", "note: --log-without-timestamp:"),
    (["-prefix-timestamp"], "out", "HVDRUN_PREFIX_TIMESTAMP=1"),
    (["--prefix-output-with-timestamp"], "out", "HVDRUN_PREFIX_TIMESTAMP=1"),
    (["-H", "localhost:1"], "out", "--nproc-per-node=1"),
    (["--hosts", "localhost:1"], "out", "--nproc-per-node=1"),
    (["--host-discovery-script", "./discover.sh"], "err", "note: --host-discovery-script: not run"),
    (["-cb"], "out", "MPI launcher"),
    (["--check-build"], "out", "MPI launcher"),
    (["--mpi"], "out", "mpirun"),
]


@pytest.fixture(autouse=True)
def _no_launcher_vars(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("flag", "where", "needle"), FLAGS, ids=[" ".join(f[0]) for f in FLAGS])
def test_every_horovodrun_flag_is_honoured_or_noted(flag, where, needle, capsys) -> None:
    assert cli.main(["--dry-run", "-np", "1", *flag, "x.py"]) == 0
    captured = capsys.readouterr()
    text = captured.out if where == "out" else captured.err
    assert needle in text, f"{needle!r} not in {where}: {text!r}"
    assert "unrecognized" not in captured.err


def test_flags_with_mpi_become_mpirun_arguments(capsys) -> None:
    argv = ["--dry-run", "--mpi", "-np", "2", "-p", "2222", "-i", "/k", "--tcp", "--mpi-args=--mca foo bar",
            "--binding-args=--bind-to core --map-by socket", "x.py"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out
    for needle in ("--mca plm_rsh_args '-p 2222 -i /k'", "--mca pml ob1", "--mca foo bar",
                   "--bind-to core --map-by socket"):
        assert needle in out, out
    assert "--bind-to none" not in out and "note:" not in captured.err


def test_mpi_and_gloo_together_is_an_error(capsys) -> None:
    assert cli.main(["--mpi", "--gloo", "-np", "2", "x.py"]) == 2
    assert "--mpi, --gloo and --jsrun choose the controller" in capsys.readouterr().err


def test_unknown_flag_is_still_an_error(capsys) -> None:
    assert cli.main(["-np", "2", "--no-such-flag", "x.py"]) == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_check_build_reports_the_mpirun_hvdrun_would_use(capsys, monkeypatch, tmp_path) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "mpirun").write_text("#!/bin/sh\n")
    (fake_bin / "mpirun").chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")  # not on PATH: found next to the interpreter
    monkeypatch.setattr(sys, "executable", str(fake_bin / "python"))
    assert cli.main(["--check-build"]) == 0
    assert f"[X] MPI launcher (mpirun: {fake_bin / 'mpirun'})" in capsys.readouterr().out
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert cli.main(["--check-build"]) == 0
    assert "[ ] MPI launcher (mpirun neither on PATH nor next to this Python)" in capsys.readouterr().out


def test_horovod_env_from_torchrun_and_mpi_variables() -> None:
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}
    assert horovod_env(torchrun, hostname="h2") == {
        "HOROVOD_RANK": "5", "HOROVOD_SIZE": "8", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "4",
        "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2", "HOROVOD_HOSTNAME": "h2"}
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}
    got = horovod_env(ompi, hostname="n")
    assert (got["HOROVOD_RANK"], got["HOROVOD_CROSS_RANK"], got["HOROVOD_CROSS_SIZE"]) == ("3", "1", "2")
    assert horovod_env({}) == {}


def test_line_prefix() -> None:
    assert prefix("1", "stdout", False) == b"[1]<stdout>:"
    stamped = prefix("0", "stderr", True).decode()
    assert stamped.endswith(" [0]<stderr>:") and len(stamped) > len("[0]<stderr>:") + 20


def test_user_error_classification_and_record(tmp_path, monkeypatch) -> None:
    assert is_peer_failure(RankFailedError("rank 1 died"))
    assert is_peer_failure(StallError("rank 1 stalled"))
    assert is_peer_failure(dist.DistBackendError("connection reset"))
    try:
        try:
            raise RankFailedError("peer")
        except RankFailedError as cause:
            raise RuntimeError("wrapped") from cause
    except RuntimeError as wrapped:
        assert is_peer_failure(wrapped)
    assert not is_peer_failure(ValueError("bad config"))
    assert not is_peer_failure(CollectiveMismatchError("shape differs"))

    monkeypatch.delenv("HVDRUN_JOB_DIR", raising=False)
    assert record_user_error(ValueError("x"), rank=0) is None  # not under hvdrun: nothing written
    monkeypatch.setenv("HVDRUN_JOB_DIR", str(tmp_path))
    assert record_user_error(RankFailedError("peer"), rank=0) is None
    assert record_user_error(ValueError("bad value 3"), rank=1) == user_error_path(tmp_path, 1)
    assert read_user_errors(tmp_path) == [{"rank": 1, "type": "ValueError", "message": "bad value 3",
                                           "exit_code": 1}]


def test_after_a_peer_failure_whatever_ends_the_function_is_one(monkeypatch) -> None:
    # TensorFlow re-raises the RankFailedError of a tf.numpy_function (the Keras allreduce) as
    # its own UnknownError, carrying only the text: the comm layer's record of it decides.
    # (The record is set by hand: exit_hard_at_exit would end this pytest process hard.)
    from hvd_trainer.comm.base import fatal

    class UnknownError(Exception):  # stands in for tensorflow.errors.UnknownError
        pass

    tf_error = UnknownError("Graph execution error: ... RankFailedError: rank 1 is no longer running")
    assert not fatal.peer_failed() and not is_peer_failure(tf_error)
    monkeypatch.setattr(fatal, "_peer_failed", True)  # what exit_hard_at_exit(PEER_FAILED_EXIT_CODE) records
    assert is_peer_failure(tf_error) and is_peer_failure(ValueError("anything"))
    monkeypatch.setattr(fatal, "_peer_failed", False)  # what recovered() does once the world is re-formed
    assert not is_peer_failure(tf_error)


def test_peer_failed_is_recorded_again_after_an_in_process_recovery() -> None:
    # In a subprocess: exit_hard_at_exit registers a hard exit at interpreter exit.
    script = (
        "from hvd_trainer.comm.base.fatal import PEER_FAILED_EXIT_CODE as P, exit_hard_at_exit, "
        "peer_failed, recovered\n"
        "assert not peer_failed()\n"
        "exit_hard_at_exit(P); assert peer_failed()\n"
        "recovered(); assert not peer_failed()\n"
        "exit_hard_at_exit(P); assert peer_failed()  # a second failure, in the re-formed world\n"
        "print('PEER_FAILED_OK')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert "PEER_FAILED_OK" in proc.stdout, proc.stdout + proc.stderr


def test_agent_watch_supports_this_torch() -> None:
    assert watch_supported(), "torch's LocalElasticAgent changed: update hvd_trainer/launch/agent_watch.py"


def test_a_killed_peer_is_never_taken_for_a_user_error() -> None:
    # A rank SIGKILLed mid-collective: its peer fails with gloo's RuntimeError (a collective that
    # did not go through comm) and would record it; the job must still be restarted.
    from types import SimpleNamespace

    from hvd_trainer.elastic.user_error import is_peer_failure
    from hvd_trainer.launch.agent_watch import _own_errors

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:33184.")
    assert is_peer_failure(gloo)
    assert is_peer_failure(ValueError("wrapped")) is False
    records = [{"rank": 0, "type": "RuntimeError", "message": "x", "exit_code": 1}]
    killed = {0: SimpleNamespace(exitcode=1), 1: SimpleNamespace(exitcode=-9)}
    own = {0: SimpleNamespace(exitcode=1), 1: SimpleNamespace(exitcode=-15)}
    assert _own_errors(records, killed) == []
    assert _own_errors(records, own) == records

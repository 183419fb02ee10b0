"""hvdrun end to end: a clean 2-rank run and the fault scenarios, as a table.

Each scenario runs ``hvdrun -np 2 fault_worker.py MODE 1 3`` (rank 1 fails at step 3 of 8)
and checks the exit status, hvdrun's own message, that no worker outlives hvdrun, and for
faults the time from the failure to hvdrun's exit (printed; asserted < 30 s).
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from hvd_trainer.launch.commands import find_mpirun
from tests.e2e.hvdrun_helpers import SCRIPTS, Result, alive, clean_env, fail_time, hvdrun, pids_from
from tests.e2e.shared_launches import TimelineProbe

WORKER = str(SCRIPTS / "fault_worker.py")

# name, worker args, expected exit status, substrings expected in the output
SCENARIOS = [
    ("clean-run", ["none", "1", "3"], 0,
     ["DONE 0", "DONE 1", "fusion=2097152", "STORE_LISTEN ['127.0.0.1']"]),
    ("rank1-raises-at-step-3", ["raise", "1", "3"], 1,
     ["hvdrun: error: rank 1 (local rank 1", "failed with exit code 1", "RuntimeError: boom at step 3"]),
    # both ranks raise on their own: the one that exits first is blamed, the other was stopped by the
    # agent (SIGTERM) or failed on its own (exit code 1), never "Also failed: rank N (signal SIGTERM)"
    ("both-raise-at-step-3", ["raise", "-1", "3"], 1,
     ["hvdrun: error: rank ", "failed with exit code 1", "RuntimeError: boom at step 3"]),
    ("rank1-sigkilled-at-step-3", ["sigkill", "1", "3"], 137,
     ["hvdrun: error: rank 1 (local rank 1", "failed with signal SIGKILL"]),
    # rank 1 exits with status 0: rank 0 must not wait forever in its next allreduce
    ("rank1-exits-0-at-step-3", ["exit0", "1", "3"], 75,
     ["RankFailedError: allreduce (unnamed) (collective", "rank 1 (pid",
      "hvdrun: error: rank 0 (local rank 0", "exit code 75 (stopped because another rank failed)",
      "No rank failed on its own: rank 1 had already ended with exit code 0"]),
]


@pytest.mark.parametrize(("worker_args", "status", "expected"), [s[1:] for s in SCENARIOS],
                         ids=[s[0] for s in SCENARIOS])
def test_hvdrun_scenario(worker_args: list[str], status: int, expected: list[str], tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    res = hvdrun(["-np", "2", "--fusion-threshold-mb", "2", "--output-filename", str(logs),
                  "--", "python", WORKER, *worker_args], timeout=120)
    assert res.returncode == status, res.explain()
    for needle in expected:
        assert needle in res.output, f"missing {needle!r}\n{res.explain()}"
    pids = pids_from(res.output)
    assert len(pids) == 2, res.explain()
    assert alive(pids) == [], f"workers left behind: {alive(pids)}\n{res.explain()}"
    logged = sorted(str(p.relative_to(logs)) for p in logs.rglob("*") if p.is_file())
    assert logged == ["rank.0/stderr", "rank.0/stdout", "rank.1/stderr", "rank.1/stdout"], logged
    for rank in (0, 1):  # the raw lines, without the console's rank prefix
        assert f"PID {rank} " in (logs / f"rank.{rank}" / "stdout").read_text()
    if status != 0:
        (verdict,) = [line for line in res.output.splitlines() if line.startswith("hvdrun: error: rank ")]
        assert "(signal SIGTERM)" not in verdict, verdict  # a rank the agent stopped is not blamed
        assert int(re.search(r"pid (\d+)\)", verdict).group(1)) in pids, (verdict, pids)  # the script's pid
        seconds = res.ended_at - fail_time(res.output)
        print(f"SCENARIO {worker_args[0]}: hvdrun exited {seconds:.1f} s after the failure")
        assert seconds < 30, res.explain()


def test_busy_forced_port_is_reported_before_start() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        res = hvdrun(["-np", "2", "--port", str(port), "python", WORKER, "none", "0", "0"], timeout=60)
    assert res.returncode == 2, res.explain()
    assert f"--port {port} is already in use" in res.output, res.explain()
    assert "PID " not in res.output, res.explain()


def test_missing_host_is_reported_within_start_timeout() -> None:
    # localhost hosts the c10d rendezvous; the second host never starts its hvdrun (same-line mode).
    res = hvdrun(["-np", "4", "-H", "localhost:2,host-that-never-joins:2", "--no-ssh", "--start-timeout", "3",
                  "python", WORKER, "none", "0", "0"], timeout=90)
    assert res.returncode == 1, res.explain()
    assert "not every host joined the rendezvous within 3 s" in res.output, res.explain()
    waited = float(res.output.split("(waited ")[1].split(" s)")[0])
    print(f"SCENARIO missing-host: reported after {waited:.1f} s of rendezvous (start timeout 3 s)")
    assert waited < 15, res.explain()


@pytest.mark.skipif(find_mpirun() is None, reason="needs Open MPI's mpirun (PATH or the venv)")
def test_mpirun_sigkill_is_reported() -> None:
    # No OMPI_ALLOW_RUN_AS_ROOT here: hvdrun passes --allow-run-as-root itself when root (CI is).
    env = clean_env(OMPI_MCA_rmaps_base_oversubscribe="1")
    res = hvdrun(["--mpi", "-np", "2", "--fusion-threshold-mb", "1", "python", WORKER, "sigkill", "1", "3"],
                 env=env, timeout=180)
    assert res.returncode != 0, res.explain()
    assert "ENV 0 fusion=1048576" in res.output and "ENV 1 fusion=1048576" in res.output, res.explain()
    assert "hvdrun: error: mpirun ended with" in res.output, res.explain()
    assert alive(pids_from(res.output)) == [], res.explain()
    seconds = res.ended_at - fail_time(res.output)
    print(f"SCENARIO mpirun-sigkill: hvdrun exited {seconds:.1f} s after the kill")
    assert seconds < 30, res.explain()


def test_lightning_stall_ends_the_job() -> None:
    """A rank that stops calling collectives: the waiting rank raises StallError naming it and
    exits (it must not hang in gloo's teardown), so hvdrun fails instead of hanging."""
    env = clean_env(HOROVOD_STALL_CHECK_TIME_SECONDS="2", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="5")
    res = hvdrun(["-np", "2", "python", str(SCRIPTS / "lightning_stall.py")], timeout=150, env=env)
    assert res.returncode != 0, res.explain()
    assert "StallError: rank(s) [1] have not reached" in res.output, res.explain()
    assert "hvdrun: error:" in res.output, res.explain()
    start = float(res.output.split("STALL rank 1 at ")[1].split()[0])
    seconds = res.ended_at - start
    print(f"SCENARIO lightning-stall: hvdrun exited {seconds:.1f} s after rank 1 stalled")
    assert seconds < 60, res.explain()


def test_timeline_written_without_shutdown(verbose_timeline_probe: TimelineProbe) -> None:
    """--timeline-filename: rank 0's Chrome trace holds the collectives even when the script
    never calls hvd.shutdown() (written at interpreter exit)."""
    import json

    res, trace = verbose_timeline_probe.result, verbose_timeline_probe.trace
    assert res.returncode == 0, res.explain()
    events = json.loads(trace.read_text())["traceEvents"]
    tensors = {e["args"].get("tensor") for e in events if e.get("ph") == "X"}
    assert "ones" in tensors, events


def test_shutdown_then_init_again_in_the_same_job() -> None:
    """torchrun's store outlives shutdown(): a second init() must not meet the first group's keys
    (it used to connect to closed gloo addresses when one rank re-initialised later)."""
    code = (
        "import time, torch, hvd_trainer as hvd\n"
        "r = hvd.init().rank\n"
        "hvd.allreduce(torch.ones(1), name='first')\n"
        "hvd.shutdown()\n"
        "time.sleep(2.0 if r == 0 else 0.0)\n"
        "hvd.init()\n"
        # one write per line: ranks share the terminal, and print() may write in pieces
        "v = hvd.allreduce(torch.full((1,), float(r)), op=hvd.Sum).item()\n"
        "import sys; sys.stdout.write(f'AGAIN {r} {v}\\n'); sys.stdout.flush()\n"
    )
    res = hvdrun(["-np", "2", "python", "-c", code], timeout=120)
    assert res.returncode == 0, res.explain()
    assert "AGAIN 0 1.0" in res.output and "AGAIN 1 1.0" in res.output, res.explain()


def test_lightning_rank_killed_while_survivor_computes(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed while rank 0 computes (no collective in flight): torchrun's agent
    SIGTERMs rank 0, whose Lightning SIGTERM handler used to run a raw ``dist.broadcast`` (gloo's
    "Connection reset by peer" traceback, exit 1). Now it raises RankFailedError naming rank 1
    at once, exits 75, and hvdrun blames rank 1 only."""
    script = str(SCRIPTS / "lightning_train.py")
    busy = str(tmp_path / "survivor-computes")  # the survivor's signal to the victim
    res = hvdrun(["-np", "2", "python", script, "--kill-rank1", "--busy-survivor", busy], timeout=150)
    assert res.returncode == 137, res.explain()
    killed = float(res.output.split("KILLED pid=")[1].split("at=")[1].split()[0])
    victim_pid = res.output.split("KILLED pid=")[1].split()[0]
    assert f"RankFailedError: rank 0's training, stopped by the launcher's SIGTERM, failed because rank 1 " \
           f"(pid {victim_pid} on" in res.output, res.explain()
    assert "Connection reset by peer" not in res.output and "Connection closed by peer" not in res.output
    assert "hvdrun: error: rank 1 (local rank 1" in res.output and "failed with signal SIGKILL" in res.output
    # rank 0 stopped because rank 1 died: a victim, not blamed ("the other ranks were stopped")
    assert "Also failed" not in res.output, res.explain()
    assert f"hvdrun: error: rank 1 (local rank 1, pid {victim_pid}) failed" in res.output  # one pid
    seconds = res.ended_at - killed
    print(f"SCENARIO lightning-kill-while-computing: hvdrun exited {seconds:.1f} s after the kill")
    assert seconds < 10, res.explain()  # ~1 s measured; the survivor's 5 s of compute is cut short


@pytest.mark.parametrize("verbose", [False, True])
def test_omp_threads_set_without_torchrun_banner(verbose: bool, request: pytest.FixtureRequest,
                                                 stamped_probe: Result) -> None:
    """Without OMP_NUM_THREADS, each of several workers per host gets 1 (torchrun's value) and
    no 4-line banner; ``--verbose`` says it in one hvdrun line. A user's value is kept.

    The jobs are shared (shared_launches.py): ``plain_probe`` / ``verbose_timeline_probe`` run
    without OMP_NUM_THREADS, ``stamped_probe`` with the user's OMP_NUM_THREADS=3."""
    res = (request.getfixturevalue("verbose_timeline_probe").result if verbose
           else request.getfixturevalue("plain_probe"))
    assert res.returncode == 0, res.explain()
    assert res.output.count("<stdout>:OMP 1") == 2, res.explain()
    assert "Setting OMP_NUM_THREADS" not in res.output and "*****" not in res.output, res.explain()
    assert ("hvdrun: OMP_NUM_THREADS=1 for each of the 2 workers" in res.output) is verbose, res.explain()
    res = stamped_probe
    assert res.output.count("<stdout>:OMP 3") == 2, res.explain()

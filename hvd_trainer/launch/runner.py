"""Run the built command and turn a failure into one clear line naming the rank and its cause.

torchrun runs in hvdrun's own process (``torch.distributed.run.run``, exactly what
``python -m torch.distributed.run`` does), so its elastic agent - which starts the local
workers, watches them every 0.1 s, and on the first failure SIGTERMs the rest (SIGKILL after
30 s) - hands hvdrun the structured failure (global rank, exit code or signal, pid) instead of
a log to parse. mpirun runs as a child process; its own report names the failed rank.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hvd_trainer.comm import PEER_FAILED_EXIT_CODE, read_records
from hvd_trainer.launch.agent_watch import AgentWatch
from hvd_trainer.launch.errors import RendezvousEndedError, RendezvousRefusedError, RendezvousUnreachableError
from hvd_trainer.launch.failures import describe_exit, exit_status, own_failures, root_failure, script_pid
from hvd_trainer.launch.guarded_rdzv import DoorRecord, use_guarded_rendezvous
from hvd_trainer.launch.loopback import use_loopback_store
from hvd_trainer.launch.partition_watch import PartitionWatch, partition_line
from hvd_trainer.launch.secret import SECRET_ENV

__all__ = ["run_torchrun", "run_mpirun", "describe_exit", "job_directory", "IN_PROCESS_EXIT_BARRIER_SECONDS"]

JOB_DIR_ENV = "HVDRUN_JOB_DIR"
"""The job directory exported to workers (read by :mod:`hvd_trainer.elastic.user_error`)."""


def _report_failures(failures: dict[int, Any], elapsed: float, world_size: int | None = None,
                     multi_host: bool = False) -> int:
    """Print hvdrun's one-line verdict on torchrun's ``{rank: ProcessFailure}``; return the status.

    ``world_size``: the job's ranks when they all ran under this agent (one host), so ranks
    missing from ``failures`` are known to have ended with status 0. ``multi_host``: the job
    spans several hosts, so a cause this agent did not see may be on another one.
    """
    ordered = root_failure(failures)
    rank, first = ordered[0]
    detail = ""
    if os.path.isfile(first.error_file) and first.message:
        detail = f": {str(first.message).strip().splitlines()[-1][:300]}"
    others = ", ".join(f"rank {r} ({describe_exit(f.exitcode)})" for r, f in own_failures(ordered))
    pid = script_pid(os.environ.get(JOB_DIR_ENV), rank, first.pid)
    print(
        f"hvdrun: error: rank {rank} (local rank {first.local_rank}, pid {pid}) failed with "
        f"{describe_exit(first.exitcode)}{detail}; the other ranks were stopped; "
        f"job ran {elapsed:.1f} s." + (f" Also failed: {others}." if others else "")
        + _early_exit_note(failures, rank, world_size, multi_host),
        file=sys.stderr,
        flush=True,
    )
    return exit_status(first.exitcode)


def _early_exit_note(failures: dict[int, Any], rank: int, world_size: int | None,
                     multi_host: bool = False) -> str:
    """When every failure only says "a peer failed": name the ranks that ended with status 0
    (torchrun does not list them), the cause hvdrun would otherwise hide behind their victim.
    In a job over several hosts the cause is on another host (a rank there died, was killed or
    ended early): this host's agent never saw it, so the note sends the user there."""
    # Ranks the agent SIGTERMed after the first failure are victims too, not causes.
    codes = {f.exitcode for f in failures.values()}
    if PEER_FAILED_EXIT_CODE not in codes or not codes <= {PEER_FAILED_EXIT_CODE, -signal.SIGTERM}:
        return ""
    if multi_host:
        return (" No rank on this host failed on its own: the first failure was on another host (a "
                "rank there crashed, was killed, or ended early, or the host went down). HINT: read "
                f"the other hosts' hvdrun output; rank {rank}'s RankFailedError above names the "
                "collective and the ranks it lost.")
    finished = sorted(set(range(world_size)) - set(failures)) if world_size else []
    if finished:
        names = ", ".join(str(r) for r in finished)
        who = f"rank{'s' if len(finished) > 1 else ''} {names} had already ended with exit code 0"
    else:
        who = "a rank not listed here had already ended (e.g. with exit code 0)"
    return (f" No rank failed on its own: {who} while rank {rank} still ran collectives. HINT: every "
            "rank must run the same collectives in the same order; do not return early on some "
            f"ranks. Rank {rank}'s RankFailedError above names the collective.")


def _agent_options(args: list[str]) -> dict[str, str]:
    """``--key=value`` options of torchrun ``args`` (hvdrun's own format), not the script's."""
    own = args[: args.index("--no-python")] if "--no-python" in args else args
    return dict(a[2:].split("=", 1) for a in own if a.startswith("--") and "=" in a)


def _multi_host(args: list[str]) -> bool:
    """Whether torchrun ``args`` start an agent of a job over several hosts (``--nnodes`` not 1)."""
    nnodes = _agent_options(args).get("nnodes")
    return nnodes is not None and nnodes not in ("1", "1:1")


def _single_host_world_size(args: list[str]) -> int | None:
    """``--nproc-per-node`` of torchrun ``args`` when ``--nnodes=1`` (hvdrun's own format), else None."""
    opts = _agent_options(args)
    if opts.get("nnodes") != "1":
        return None
    try:
        return int(opts.get("nproc-per-node", ""))
    except ValueError:
        return None


def _report_user_error(record: dict[str, Any], failures: dict[int, Any], watch: AgentWatch) -> int:
    rank = int(record.get("rank", 0))
    failure = failures.get(rank)
    code = failure.exitcode if failure is not None else int(record.get("exit_code", 1))
    message = " ".join(str(record.get("message", "")).split())[:500]
    print(
        f"hvdrun: error: rank {rank} failed with {describe_exit(code)}: {record.get('type')}: {message} "
        f"(an exception of the program, not a peer's failure: not retried; "
        f"{watch.restarts_used} of {watch.max_restarts} restarts used)",
        file=sys.stderr, flush=True,
    )
    return exit_status(code)


def _set_omp_threads(args: list[str], verbose: bool) -> None:
    """``OMP_NUM_THREADS=1`` for several workers per host when the user set none: the value
    torchrun would set itself, without its 4-line banner (one line with ``--verbose``)."""
    try:
        per_host = int(_agent_options(args).get("nproc-per-node", "1"))
    except ValueError:
        return
    if per_host > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        if verbose:
            print(f"hvdrun: OMP_NUM_THREADS=1 for each of the {per_host} workers per host (set it to "
                  "change this)", file=sys.stderr, flush=True)


def _run_agent(args: list[str], watch: AgentWatch, secret: str | None, spares: bool,
               door: DoorRecord) -> None:
    from torch.distributed.run import parse_args, run

    parsed = parse_args(args)
    use_loopback_store(parsed) or use_guarded_rendezvous(parsed, secret, spares=spares, record=door)
    if parsed.log_dir is None and os.environ.get(JOB_DIR_ENV):
        # torchrun's per-attempt folders (error files) go in the job directory, removed at the
        # end, instead of a <tmp>/torchelastic_* folder left behind by every job
        parsed.log_dir = os.path.join(os.environ[JOB_DIR_ENV], "torchelastic")
    with watch.installed():
        run(parsed)


IN_PROCESS_EXIT_BARRIER_SECONDS = 20.0
"""How long a finished agent waits for the other hosts' agents with in-process recovery
(torchrun's default is 300 s): a host lost during the job stays in the rendezvous, since the
survivors re-formed their world without a new one, and would hold the others for the full wait."""


def _raise_unless_vanished(_func: object, _path: str, exc_info: Any) -> None:
    if not issubclass(exc_info[0], FileNotFoundError):  # removed meanwhile: what rmtree wants
        raise exc_info[1]


@contextlib.contextmanager
def job_directory() -> Iterator[Path]:
    """A fresh ``<tmp>/hvdrun-job-*`` directory (``HVDRUN_JOB_DIR``), removed at the end.

    A directory that cannot be removed (e.g. a worker still running writes into it) is named in
    a warning line on stderr and left behind; no error is raised, so the job's own result and
    exit status stand.
    """
    path = Path(tempfile.mkdtemp(prefix="hvdrun-job-"))
    try:
        yield path
    finally:
        try:
            shutil.rmtree(path, onerror=_raise_unless_vanished)
        except OSError as exc:
            print(f"hvdrun: warning: could not remove the job's temporary directory {path} ({exc}); "
                  "it is left behind. HINT: remove it once no process of the job runs.",
                  file=sys.stderr, flush=True)


def run_torchrun(
    args: list[str], env: dict[str, str], *, start_timeout_seconds: float, verbose: bool = False,
    max_restarts: int = 0, exit_barrier_seconds: float | None = None, respawn_budget: int = 0,
    spares: bool = False,
) -> int:
    """Run torchrun with ``args`` in this process; return hvdrun's exit status (0 = success).

    The workers get ``HVDRUN_JOB_DIR`` (a fresh temporary directory, removed at the end) for
    their user-error records; restarts are announced and counted (:class:`AgentWatch`), and
    with restarts allowed (or in-process recovery) the last lines say how many were used.
    ``exit_barrier_seconds``: how long a finished agent waits for the other hosts' agents
    (``None``: torchrun's 300 s). ``respawn_budget``: ``HVDRUN_RESPAWNS`` with in-process
    recovery (0 without). The agents meet in :mod:`~hvd_trainer.launch.guarded_rdzv`'s
    rendezvous, keyed with the job's secret from ``env``; ``spares``: an agent that finds the job
    full waits as a spare (elastic) instead of being refused.
    """
    import logging

    os.environ.update(env)
    _set_omp_threads(args, verbose)
    if verbose:
        logging.getLogger("torch.distributed.elastic").setLevel(logging.INFO)
    else:
        # "Sending process <pid> closing signal SIGTERM", "failed (exitcode: 1) local_rank: 0
        # (pid: <pid>)": the worker entries' pids, not the ranks'; hvdrun's own line says it
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    with job_directory() as job_dir:
        os.environ[JOB_DIR_ENV] = str(job_dir)
        watch = AgentWatch(job_dir, max_restarts, exit_barrier_seconds=exit_barrier_seconds,
                           respawn_budget=respawn_budget)
        try:
            with PartitionWatch(job_dir):
                return _run_watched(args, watch, start_timeout_seconds, env.get(SECRET_ENV), spares)
        finally:
            os.environ.pop(JOB_DIR_ENV, None)


def _run_watched(args: list[str], watch: AgentWatch, start_timeout_seconds: float,
                 secret: str | None, spares: bool) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    start = time.monotonic()
    door = DoorRecord()
    try:
        _run_agent(args, watch, secret, spares, door)
    except ChildFailedError as exc:
        if watch.user_error is not None:
            return _report_user_error(watch.user_error, exc.failures, watch)
        _print_summary(watch)
        partition = partition_line(read_records(watch.job_dir))
        if partition is not None:  # the ranks' exit codes only say "a peer failed"
            print(partition, file=sys.stderr, flush=True)
        return _report_failures(exc.failures, time.monotonic() - start, _single_host_world_size(args),
                                _multi_host(args))
    except SignalException as exc:
        print(f"hvdrun: stopped by {signal.Signals(exc.sigval).name}; workers were terminated.",
              file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    except (RendezvousRefusedError, RendezvousUnreachableError) as exc:
        return _report_door(exc, time.monotonic() - start)
    except RendezvousTimeoutError:
        print(f"hvdrun: error: not every host joined the rendezvous within {start_timeout_seconds:g} s "
              f"(waited {time.monotonic() - start:.1f} s). HINT: run the same hvdrun command on every "
              "host listed in -H/--hostfile, check that they can reach the first host's --port, or "
              "raise --start-timeout.", file=sys.stderr, flush=True)
        return 1
    except (RendezvousConnectionError, RendezvousEndedError) as exc:
        return _report_lost_rendezvous(exc, door, spares)
    except Exception as exc:  # noqa: BLE001 - rendezvous/store errors: report, don't dump
        return _report_start_error(exc)
    _print_summary(watch)
    return 0


def _report_door(exc: RendezvousRefusedError | RendezvousUnreachableError, waited: float) -> int:
    if isinstance(exc, RendezvousRefusedError):
        print(f"hvdrun: refused: {exc}", file=sys.stderr, flush=True)
    else:
        print(f"hvdrun: error: {exc} (waited {waited:.1f} s)", file=sys.stderr, flush=True)
    return 1


def _report_lost_rendezvous(exc: BaseException, door: DoorRecord, spares: bool) -> int:
    """The rendezvous store went away. An elastic agent that never got a place (a spare) ran
    nothing and failed nothing: a line, exit 0. Anything else is the job's failure to start."""
    if not (spares and door.handler is not None and not door.joined):
        return _report_start_error(exc)
    closed = isinstance(exc, RendezvousEndedError) or door.saw_closed()
    how = "the job ended" if closed else "the job ended, or its first host stopped"
    print(f"hvdrun: the job's rendezvous at {door.endpoint} went away while this host waited as a "
          f"spare ({how}); nothing ran on this host.", file=sys.stderr, flush=True)
    return 0


def _report_start_error(exc: BaseException) -> int:
    print(f"hvdrun: error: the job could not start or finish: {type(exc).__name__}: {exc}",
          file=sys.stderr, flush=True)
    return 1


def _print_summary(watch: AgentWatch) -> None:
    line = watch.summary()
    if line is not None:
        print(line, file=sys.stderr, flush=True)


def run_mpirun(cmd: list[str]) -> int:
    """Run mpirun as a child process; on failure add hvdrun's own line to mpirun's report."""
    start = time.monotonic()
    code = subprocess.call(cmd)
    if code != 0:
        print(f"hvdrun: error: mpirun ended with {describe_exit(code)} after "
              f"{time.monotonic() - start:.1f} s; its report above names the failed rank.",
              file=sys.stderr, flush=True)
    return exit_status(code) if code else 0

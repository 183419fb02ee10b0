"""Run the built command and turn a failure into one clear line naming the rank and its cause.

torchrun runs in hvdrun's own process (``torch.distributed.run.run``, exactly what
``python -m torch.distributed.run`` does), so its elastic agent - which starts the local
workers, watches them every 0.1 s, and on the first failure SIGTERMs the rest (SIGKILL after
30 s) - hands hvdrun the structured failure (global rank, exit code or signal, pid) instead of
a log to parse. mpirun runs as a child process; its own report names the failed rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from hvd_trainer.comm.fatal import PEER_FAILED_EXIT_CODE
from hvd_trainer.launch.loopback import use_loopback_store

__all__ = ["run_torchrun", "run_mpirun", "describe_exit"]


def describe_exit(exitcode: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL"`` (negative codes are signals, as in Popen)."""
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    if exitcode == PEER_FAILED_EXIT_CODE:
        return f"exit code {exitcode} (stopped because another rank failed)"
    return f"exit code {exitcode}"


def _status(exitcode: int) -> int:
    """Shell-style status for hvdrun: the exit code, or 128 + signal number."""
    return 128 - exitcode if exitcode < 0 else max(exitcode, 1)


def _report_failures(failures: dict[int, Any], elapsed: float) -> int:
    # The root cause is the failure the agent did not cause itself: it stops the surviving
    # workers with SIGTERM, which then show up as failures too (timestamps are whole seconds),
    # and a rank that stopped because a peer failed exits with PEER_FAILED_EXIT_CODE.
    ordered = sorted(
        failures.items(),
        key=lambda item: (
            item[1].exitcode in (-signal.SIGTERM, PEER_FAILED_EXIT_CODE), item[1].timestamp, item[0]
        ),
    )
    rank, first = ordered[0]
    detail = ""
    if os.path.isfile(first.error_file) and first.message:
        detail = f": {str(first.message).strip().splitlines()[-1][:300]}"
    others = ", ".join(f"rank {r} ({describe_exit(f.exitcode)})" for r, f in ordered[1:])
    print(
        f"hvdrun: error: rank {rank} (local rank {first.local_rank}, pid {first.pid}) failed with "
        f"{describe_exit(first.exitcode)}{detail}; the other ranks were stopped; "
        f"job ran {elapsed:.1f} s." + (f" Also failed: {others}." if others else ""),
        file=sys.stderr,
        flush=True,
    )
    return _status(first.exitcode)


def run_torchrun(
    args: list[str], env: dict[str, str], *, start_timeout_seconds: float, verbose: bool = False
) -> int:
    """Run torchrun with ``args`` in this process; return hvdrun's exit status (0 = success)."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.run import parse_args, run

    os.environ.update(env)
    if verbose:
        logging.getLogger("torch.distributed.elastic").setLevel(logging.INFO)
    start = time.monotonic()
    try:
        parsed = parse_args(args)
        use_loopback_store(parsed)
        run(parsed)
    except ChildFailedError as exc:
        return _report_failures(exc.failures, time.monotonic() - start)
    except SignalException as exc:
        print(f"hvdrun: stopped by {signal.Signals(exc.sigval).name}; workers were terminated.",
              file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    except RendezvousTimeoutError:
        print(f"hvdrun: error: not every host joined the rendezvous within {start_timeout_seconds:g} s "
              f"(waited {time.monotonic() - start:.1f} s). HINT: run the same hvdrun command on every "
              "host listed in -H/--hostfile, check that they can reach the first host's --port, or "
              "raise --start-timeout.", file=sys.stderr, flush=True)
        return 1
    except Exception as exc:  # noqa: BLE001 - rendezvous/store errors: report, don't dump
        print(f"hvdrun: error: the job could not start or finish: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        return 1
    return 0


def run_mpirun(cmd: list[str]) -> int:
    """Run mpirun as a child process; on failure add hvdrun's own line to mpirun's report."""
    start = time.monotonic()
    code = subprocess.call(cmd)
    if code != 0:
        print(f"hvdrun: error: mpirun ended with {describe_exit(code)} after "
              f"{time.monotonic() - start:.1f} s; its report above names the failed rank.",
              file=sys.stderr, flush=True)
    return _status(code) if code else 0

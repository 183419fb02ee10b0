"""One command starts the whole job: this host's agent in-process, every other host's over ssh.

``hvdrun -np 8 -H a:4,b:4 python train.py`` run on ``a`` starts ``b``'s torchrun agent over ssh
(:mod:`hvd_trainer.launch.ssh`) and its own agent here (a host of ``-H`` that is this machine
needs no ssh). The job ends together:

* this host's agent fails, or hvdrun gets Ctrl-C / SIGTERM: every ssh session's stdin is
  closed, which stops that host's agent and its workers (then the ssh clients are ended);
* a remote session ends non-zero (its workers failed, ssh could not connect, the host died):
  the surviving agents usually fail on their own within seconds (a peer's failure is detected
  by the comm layer); after :data:`REMOTE_FAILURE_GRACE_SECONDS` this host's agent is sent
  SIGTERM, and hvdrun's last line names the host and its status.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

from hvd_trainer.comm import PEER_FAILED_EXIT_CODE
from hvd_trainer.launch.failures import describe_exit, exit_status
from hvd_trainer.launch.options import HvdrunOptions
from hvd_trainer.launch.remote_agents import RemoteAgents, RemoteExit
from hvd_trainer.launch.ssh import carried_env, ssh_command

__all__ = ["REMOTE_FAILURE_GRACE_SECONDS", "RemoteHostFailed", "remote_commands", "run_with_remote_agents"]

REMOTE_FAILURE_GRACE_SECONDS = 5.0
"""How long this host's agent may take to fail by itself after another host's agent failed."""


class RemoteHostFailed(RuntimeError):
    """Raised in the main thread (from SIGTERM) when another host's agent ended first."""


def remote_commands(opts: HvdrunOptions, local_index: int | None) -> dict[str, list[str]]:
    """``{host: ssh argv}`` for every host of the job except ``local_index`` (this machine)."""
    return {h.host: ssh_command(opts, h) for i, h in enumerate(opts.hosts) if i != local_index}


def _explain(failure: RemoteExit) -> str:
    cause = ("ssh could not connect or the connection dropped" if failure.returncode == 255
             else f"its agent ended with {describe_exit(failure.returncode)}")
    return (f"hvdrun: error: host {failure.host}: {cause} after {failure.seconds:.1f} s (its output above); "
            "every host's processes were stopped.")


def run_with_remote_agents(opts: HvdrunOptions, local_index: int | None,
                           run_local: Callable[[], int]) -> int:
    """Start the other hosts' agents, run ``run_local`` (this host's agent; ``local_index`` None:
    none here), stop everything together; returns hvdrun's exit status."""
    local_done = threading.Event()

    def on_failure(_: RemoteExit) -> None:
        def stop_local() -> None:
            if not local_done.wait(REMOTE_FAILURE_GRACE_SECONDS):
                os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=stop_local, daemon=True).start()

    agents = RemoteAgents(remote_commands(opts, local_index), carried_env(os.environ), on_failure)
    previous = signal.signal(signal.SIGTERM, _raise_remote_failed)
    code = 0
    try:
        agents.start()
        if local_index is not None:
            code = run_local()
        if code == 0:
            agents.wait()  # the others finish their own shutdown (a failure there still counts)
    except RemoteHostFailed:
        code = 1
    except KeyboardInterrupt:
        print("hvdrun: stopped by SIGINT; every host's processes were stopped.", file=sys.stderr, flush=True)
        code = 130
    finally:
        local_done.set()
        signal.signal(signal.SIGTERM, previous)
        agents.stop()
    return _status(code, agents)


def _status(code: int, agents: RemoteAgents) -> int:
    """This host's status unless another host's agent failed first (not merely stopped by ours)."""
    failure = agents.failure
    if failure is None and code == 0:
        failure = next((e for e in agents.exits.values() if e.returncode != 0), None)
    if failure is None or (code != 0 and failure.returncode == PEER_FAILED_EXIT_CODE):
        return code
    print(_explain(failure), file=sys.stderr, flush=True)
    return exit_status(failure.returncode)


def _raise_remote_failed(signum: int, frame: FrameType | None) -> None:
    raise RemoteHostFailed("another host's agent failed")

"""The ssh command that starts one other host's torchrun agent (as ``horovodrun`` does).

hvdrun on the launching host runs, for every other host of ``-H``/``--hostfile``::

    ssh [-p PORT] [-i KEY] -o BatchMode=yes -o StrictHostKeyChecking=accept-new ... HOST \\
        'cd <cwd> && exec <python> -m hvd_trainer.launch.ssh_child --this-host HOST <hvdrun args>'

The remote side is the same hvdrun in same-line mode for that host alone. Its environment
(:func:`carried_env`: ``PATH``, ``PYTHONPATH``, ``HOROVOD_*``, ``NCCL_*``, ``GLOO_*``, ...) is
sent as one JSON line on the session's stdin, never on the command line, so nothing secret
shows in ``ps`` or ``--dry-run``; the stdin then stays open, and its end (the launcher stopped or
died, the connection dropped) stops the remote agent and its workers.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping

from hvd_trainer.launch.hosts import HostSlots
from hvd_trainer.launch.options import HvdrunOptions

__all__ = ["CARRIED_PREFIXES", "CARRIED_NAMES", "carried_env", "remote_argv", "ssh_command", "env_line"]

CARRIED_PREFIXES = ("HOROVOD_", "HVDRUN_", "NCCL_", "GLOO_", "TORCH_", "TORCHELASTIC_USE_", "CUDA_",
                    "OMP_", "MKL_", "PYTHON", "KERAS_", "TF_", "LD_", "LC_")
"""Variables with these prefixes travel to the other hosts (what a training job reads)."""
CARRIED_NAMES = ("PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "LANG", "TZ", "TMPDIR", "HF_HOME", "XDG_CACHE_HOME")
"""Variables with these exact names travel too."""
_NOT_CARRIED = frozenset({"HVDRUN_JOB_DIR"})  # each agent makes its own job directory


def carried_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` the other hosts' agents get (names in :data:`CARRIED_PREFIXES` /
    :data:`CARRIED_NAMES`; horovodrun has no ``-x``: it forwards the environment, so do we)."""
    return {k: v for k, v in environ.items()
            if (k in CARRIED_NAMES or k.startswith(CARRIED_PREFIXES)) and k not in _NOT_CARRIED}


def env_line(env: Mapping[str, str]) -> bytes:
    """The first stdin line of a remote session: the environment as one JSON object."""
    return json.dumps({"env": dict(env)}).encode() + b"\n"


def remote_argv(opts: HvdrunOptions, host: HostSlots) -> list[str]:
    """hvdrun's own arguments for ``host``'s agent: same-line mode for that host alone (a
    ``--dry-run`` of the launcher is not passed on: the printed command is the real one)."""
    split = len(opts.argv) - len(opts.command)
    flags = [a for a in opts.argv[:split] if a != "--dry-run"]
    return ["--this-host", host.host, *flags, *opts.argv[split:]]


def ssh_command(opts: HvdrunOptions, host: HostSlots, cwd: str | None = None) -> list[str]:
    """``ssh ... HOST '<cd && exec remote hvdrun>'`` for one other host (``-p``/``-i`` as given)."""
    ssh = ["ssh"]
    if opts.ssh_port is not None:
        ssh += ["-p", str(opts.ssh_port)]
    if opts.ssh_identity_file is not None:
        ssh += ["-i", opts.ssh_identity_file]
    connect = max(1, round(opts.start_timeout_seconds))
    # a session silent 3 x 3 s is given up, in step with the peer timeout's default (10 s), so
    # after a cut hvdrun's stop does not wait for a session that can no longer answer
    ssh += ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
            "-o", f"ConnectTimeout={connect}", "-o", "ServerAliveInterval=3", "-o", "ServerAliveCountMax=3",
            "-o", "LogLevel=ERROR"]
    for option in opts.ssh_options:
        ssh += ["-o", option]
    here = cwd if cwd is not None else os.getcwd()
    # PYTHONPATH must be set before Python starts (it decides where hvd_trainer is imported from);
    # every other variable arrives on stdin.
    path = os.environ.get("PYTHONPATH")
    start = f"env PYTHONPATH={shlex.quote(path)} " if path else ""
    remote = (f"cd {shlex.quote(here)} && exec {start}{shlex.quote(sys.executable)} "
              f"-m hvd_trainer.launch.ssh_child {shlex.join(remote_argv(opts, host))}")
    return [*ssh, host.host, remote]

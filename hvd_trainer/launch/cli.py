"""``hvdrun -np N [options] [--] COMMAND ...``: Horovod's launcher flags on torchrun or mpirun.

Single host (the default, ``localhost:N``)::

    hvdrun -np 4 python train.py           # torchrun, rendezvous on 127.0.0.1:<free port>

Several hosts with torchrun: run the *same* command on every host (hvdrun starts nothing on
other machines); each host's torchrun agent joins the c10d rendezvous on the first host::

    host1$ hvdrun -np 8 -H host1:4,host2:4 --port 29400 python train.py
    host2$ hvdrun -np 8 -H host1:4,host2:4 --port 29400 python train.py

With ``--mpi``, mpirun starts every process (over its own ssh/daemons)::

    hvdrun --mpi -np 8 -H host1:4,host2:4 python train.py

All checks (unknown flags, ``-np < 1``, more processes per host than GPUs when CUDA is used,
a busy forced ``--port``, running inside a worker) happen before anything starts.
``--dry-run`` prints the exact command; the torchrun form is run in-process, which is what
``python -m torch.distributed.run`` does.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from importlib.metadata import version

from hvd_trainer.comm.launch_env import worker_launcher
from hvd_trainer.launch.check_build import check_build_report
from hvd_trainer.launch.commands import mpirun_command, pick_port, restarts, torchrun_args, worker_env
from hvd_trainer.launch.errors import HvdrunError
from hvd_trainer.launch.options import HvdrunOptions, build_parser, parse_options
from hvd_trainer.launch.runner import run_mpirun, run_torchrun
from hvd_trainer.launch.secret import SECRET_ENV, job_secret, masked

__all__ = ["build_parser", "build_torchrun_command", "main", "HvdrunError"]


def _check_devices(opts: HvdrunOptions) -> None:
    import torch

    if opts.device == "cpu":
        return
    cuda = torch.cuda.is_available()
    if opts.device == "cuda" and not cuda:
        raise HvdrunError(
            "--device cuda was requested but torch.cuda.is_available() is False. "
            "HINT: use --device cpu (gloo) or install a CUDA build of torch."
        )
    count = torch.cuda.device_count() if cuda else 0
    if cuda and opts.procs_per_host > count:
        raise HvdrunError(
            f"{opts.procs_per_host} processes per host but this host has {count} GPU(s). "
            f"HINT: -np {count * len(opts.hosts)} (one process per GPU), or --device cpu."
        )


def _check_not_in_worker() -> None:
    launcher = worker_launcher(os.environ)
    if launcher is not None:
        raise HvdrunError(
            f"hvdrun is running inside a process already launched by {launcher} "
            "(its rank variables are set). HINT: run your script directly here, or start "
            "hvdrun from a plain shell."
        )


def build_torchrun_command(opts: HvdrunOptions, port: int | None = None) -> list[str]:
    """The full ``python -m torch.distributed.run ...`` command for ``opts``."""
    port = pick_port(opts) if port is None else port
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(opts, port)]


def _env_prefix(env: dict[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))


def _launch(opts: HvdrunOptions) -> int:
    _check_not_in_worker()
    _check_devices(opts)
    for note in opts.notes:
        print(note, file=sys.stderr, flush=True)
    port = pick_port(opts)
    env = worker_env(opts)
    secret, warning = job_secret(opts)
    if warning is not None and not opts.dry_run:
        print(warning, file=sys.stderr, flush=True)
    if secret is not None:
        env[SECRET_ENV] = secret  # workers inherit it from hvdrun's environment, never argv
    if opts.use_mpi:
        cmd = mpirun_command(opts, port)
        if secret is not None:
            os.environ[SECRET_ENV] = secret
            cmd[1:1] = ["-x", SECRET_ENV]  # exported by name: the value stays off the command line
        shown = shlex.join(cmd)
    else:
        cmd = build_torchrun_command(opts, port)
        shown = (_env_prefix(masked(env)) + " " if env else "") + shlex.join(cmd)
    if opts.dry_run or opts.verbose:
        print(shown, file=sys.stdout if opts.dry_run else sys.stderr, flush=True)
    if opts.dry_run:
        return 0
    if opts.use_mpi:
        return run_mpirun(cmd)
    return run_torchrun(cmd[3:], env, start_timeout_seconds=opts.start_timeout_seconds,
                        verbose=opts.verbose, max_restarts=restarts(opts))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hvdrun``; returns the exit status (0, 2 for usage errors, else failure)."""
    try:
        opts, ns = parse_options(sys.argv[1:] if argv is None else argv)
        if opts is None:
            print(f"hvdrun (hvd_trainer) {version('hvd_trainer')}" if ns.version else check_build_report())
            return 0
        return _launch(opts)
    except HvdrunError as exc:
        print(f"hvdrun: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

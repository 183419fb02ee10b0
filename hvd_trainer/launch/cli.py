"""``hvdrun -np N [--] COMMAND ...``: run COMMAND on N local processes through torchrun.

hvdrun manages no processes itself: it builds a ``python -m torch.distributed.run`` command
bound to loopback on a free port, runs it, and returns the workers' exit status.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Sequence

from hvd_trainer.comm.world import free_port

__all__ = ["build_parser", "build_torchrun_command", "main"]


class HvdrunError(ValueError):
    """Bad hvdrun arguments; the message says what to change."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hvdrun",
        description="Launch COMMAND on N processes (torchrun underneath).",
        usage="hvdrun -np N [options] [--] COMMAND [ARGS ...]",
    )
    parser.add_argument("-np", "--num-proc", type=int, required=True, dest="num_proc",
                        help="number of processes to start")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the underlying command instead of running it")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    return parser


def build_torchrun_command(
    num_proc: int, command: Sequence[str], *, master_port: int | None = None
) -> list[str]:
    """The torchrun command that runs ``command`` on ``num_proc`` local processes.

    A command whose first word ends in ``.py``, or is ``python``/``python3``, is run with the
    interpreter running hvdrun, so workers see the same environment.

    Raises:
        HvdrunError: ``num_proc < 1`` or an empty command.
    """
    if num_proc < 1:
        raise HvdrunError(f"-np must be >= 1, got {num_proc}.")
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise HvdrunError("no command given. HINT: hvdrun -np 2 python train.py")
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    elif command[0] in ("python", "python3"):
        # The interpreter that runs hvdrun (its venv), not whichever "python" is first on PATH.
        command = [sys.executable, *command[1:]]
    port = free_port() if master_port is None else master_port
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1", f"--nproc-per-node={num_proc}",
        "--master-addr=127.0.0.1", f"--master-port={port}",
        "--no-python",
        *command,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hvdrun``; returns the workers' exit status."""
    args = build_parser().parse_args(argv)
    try:
        cmd = build_torchrun_command(args.num_proc, args.command)
    except HvdrunError as exc:
        print(f"hvdrun: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())

"""``hvdrun -np N [options] [--] COMMAND ...``: Horovod's launcher flags on torchrun or mpirun.

Single host (the default, ``localhost:N``)::

    hvdrun -np 4 python train.py           # torchrun, rendezvous on 127.0.0.1:<free port>

Several hosts with torchrun, one command (as horovodrun): hvdrun starts this host's agent and
every other host's over ssh (``-p``, ``-i``; see :mod:`hvd_trainer.launch.ssh_launch`)::

    host1$ hvdrun -np 8 -H host1:4,host2:4 python train.py

or the *same* line on every host (``--no-ssh``); each host's torchrun agent joins the c10d
rendezvous on the first host::

    host1$ hvdrun -np 8 -H host1:4,host2:4 --port 29400 --no-ssh python train.py
    host2$ hvdrun -np 8 -H host1:4,host2:4 --port 29400 --no-ssh python train.py

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
import uuid
from collections.abc import Sequence
from importlib.metadata import version

from hvd_trainer.comm import worker_launcher
from hvd_trainer.launch.agent_identity import AgentIdentity, identify, interface_env
from hvd_trainer.launch.check_build import check_build_report
from hvd_trainer.launch.commands import mpirun_command, pick_port, restarts, torchrun_args, worker_env
from hvd_trainer.launch.errors import HvdrunError
from hvd_trainer.launch.options import HvdrunOptions, build_parser, parse_options
from hvd_trainer.launch.runner import IN_PROCESS_EXIT_BARRIER_SECONDS, run_mpirun, run_torchrun
from hvd_trainer.launch.secret import SECRET_ENV, job_secret, masked
from hvd_trainer.launch.ssh_launch import remote_commands, run_with_remote_agents
from hvd_trainer.launch.this_host import find_this_host

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


def build_torchrun_command(opts: HvdrunOptions, port: int | None = None,
                           agent: AgentIdentity | None = None) -> list[str]:
    """The full ``python -m torch.distributed.run ...`` command for ``opts`` (``agent``: the host
    it runs on, several hosts only)."""
    port = pick_port(opts) if port is None else port
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(opts, port, agent)]


def _env_prefix(env: dict[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))


def _uses_ssh(opts: HvdrunOptions) -> bool:
    return opts.multi_host and not (opts.use_mpi or opts.no_ssh or opts.this_host)


def _ssh_agent(opts: HvdrunOptions) -> AgentIdentity | None:
    """This host's identity in an ssh launch (None: not one of the hosts, every agent is remote)."""
    index = find_this_host(opts.hosts)
    if opts.hosts[0].is_local:
        raise HvdrunError(
            f"-H {opts.hosts_spec}: the first host is the rendezvous host, and the other hosts cannot "
            f"reach {opts.hosts[0].host!r}. HINT: name this machine by a name or address the others reach."
        )
    return None if index is None else identify(opts.hosts, opts.hosts[index].host, opts.network_interface)


def _show(opts: HvdrunOptions, lines: list[str]) -> None:
    if opts.dry_run or opts.verbose:
        print("\n".join(lines), file=sys.stdout if opts.dry_run else sys.stderr, flush=True)


def _remote_lines(opts: HvdrunOptions, port: int, env: dict[str, str], host: str,
                  ssh: list[str]) -> list[str]:
    """The ssh command for ``host`` and, as a comment, the torchrun command its agent will run."""
    names = [h.host for h in opts.hosts]
    address = host if opts.network_interface is None else f"<{opts.network_interface} address on {host}>"
    agent = AgentIdentity(index=names.index(host), host=host, address=address)
    remote = build_torchrun_command(opts, port, agent)
    shown = (_env_prefix(env) + " " if env else "") + shlex.join(remote)
    return [shlex.join(ssh), f"# {host} runs: {shown}"]


def _job_secret(opts: HvdrunOptions, env: dict[str, str]) -> str | None:
    """Make or take the job's secret (:mod:`~hvd_trainer.launch.secret`) and put it in ``env``
    and in hvdrun's own environment, where the agents, mpirun's ``-x`` and the ssh sessions'
    carried variables pick it up; print the warning when the job has none."""
    secret, warning = job_secret(opts)
    if warning is not None and not opts.dry_run:
        print(warning, file=sys.stderr, flush=True)
    if secret is not None:
        env[SECRET_ENV] = secret  # workers inherit it from hvdrun's environment, never argv
        if not opts.dry_run:
            os.environ[SECRET_ENV] = secret
    return secret


def _launch_mpi(opts: HvdrunOptions, port: int, secret: str | None) -> int:
    cmd = mpirun_command(opts, port)
    if secret is not None:
        cmd[1:1] = ["-x", SECRET_ENV]  # exported by name: the value stays off the command line
    _show(opts, [shlex.join(cmd)])
    return 0 if opts.dry_run else run_mpirun(cmd)


def _launch(opts: HvdrunOptions) -> int:
    _check_not_in_worker()
    _check_devices(opts)
    if opts.this_host is None:
        for note in opts.notes:
            print(note, file=sys.stderr, flush=True)
    port = pick_port(opts)
    env = worker_env(opts)
    secret = _job_secret(opts, env)
    if opts.use_mpi:
        return _launch_mpi(opts, port, secret)
    ssh = _uses_ssh(opts)
    if ssh:
        if opts.rdzv_id is None:  # one fresh id per job, handed to every host
            opts.rdzv_id = f"hvdrun-{uuid.uuid4().hex[:12]}"
            opts.argv = ["--rdzv-id", opts.rdzv_id, *opts.argv]
        agent = _ssh_agent(opts)
    else:
        agent = (identify(opts.hosts, opts.this_host, opts.network_interface, opts.elastic)
                 if opts.multi_host else None)
    if agent is not None and opts.network_interface is None:
        env.update(interface_env(agent, {**os.environ, **env}))
    cmd = build_torchrun_command(opts, port, agent)
    shown = (_env_prefix(masked(env)) + " " if env else "") + shlex.join(cmd)
    commands = remote_commands(opts, None if agent is None else agent.index) if ssh else {}
    _show(opts, [line for host, c in commands.items()
                 for line in _remote_lines(opts, port, masked(env), host, c)]
          + ([shown] if agent or not ssh else []))
    if opts.dry_run:
        return 0

    def run_local() -> int:
        in_process = opts.recovery == "in-process"
        return run_torchrun(cmd[3:], env, start_timeout_seconds=opts.start_timeout_seconds,
                            verbose=opts.verbose, max_restarts=0 if in_process else restarts(opts),
                            exit_barrier_seconds=IN_PROCESS_EXIT_BARRIER_SECONDS if in_process else None,
                            respawn_budget=restarts(opts) if in_process else 0, spares=opts.elastic)

    if ssh:
        return run_with_remote_agents(opts, None if agent is None else agent.index, run_local)
    return run_local()


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

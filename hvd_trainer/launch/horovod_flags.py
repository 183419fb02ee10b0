"""horovodrun's flags that hvdrun accepts beyond its own: each is honoured or noted.

A script written for ``horovodrun`` keeps its command line under ``hvdrun``: no flag of
``horovodrun`` (Horovod's ``runner/launch.py``) is ever ``unrecognized``. Each one here is either

* honoured: turned into a worker variable (:data:`ENV_FLAGS`), or into mpirun arguments with
  ``--mpi`` (:func:`mpirun_extra_args`), or handled by the launcher (``--version``,
  ``--prefix-output-with-timestamp``, ``--elastic-timeout``); or
* accepted with one ``hvdrun: note: ...`` line on stderr saying why it does not apply
  (:data:`NOTES`; printed by :func:`notes_for`).
"""

from __future__ import annotations

import argparse
import shlex

__all__ = ["ENV_FLAGS", "NOTES", "MPI_ONLY_NOTES", "SSH_NOTES", "add_horovod_flags", "flag_env", "notes_for",
           "mpirun_extra_args"]

ENV_FLAGS: dict[str, str] = {
    "stall_check_warning_time_seconds": "HOROVOD_STALL_CHECK_TIME_SECONDS",
    "stall_check_shutdown_time_seconds": "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    "log_level": "HOROVOD_LOG_LEVEL",
    "autotune_log_file": "HOROVOD_AUTOTUNE_LOG",
    "autotune_warmup_samples": "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
    "autotune_steps_per_sample": "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
    "autotune_bayes_opt_max_samples": "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "gloo_timeout_seconds": "HOROVOD_GLOO_TIMEOUT_SECONDS",
}
"""Flag (argparse dest) -> worker variable it is exported as (``--no-stall-check`` sets
``HOROVOD_STALL_CHECK_DISABLE=1``)."""

_NO_CYCLES = "buckets launch when full (hook-driven); there is no background cycle or response cache"
NOTES: dict[str, str] = {
    "gloo": "torchrun with gloo (CPU) / NCCL (CUDA) is already hvdrun's default controller",
    "jsrun": "hvdrun does not launch through jsrun; using torchrun. HINT: under LSF run "
             "`jsrun ... python train.py` yourself, init() reads the MPI variables",
    "disable_cache": "hvdrun keeps no cache of host checks; nothing to disable",
    "config_file": "hvdrun does not read horovodrun's YAML config. HINT: pass those settings as flags",
    "cache_capacity": f"ignored: {_NO_CYCLES}",
    "hierarchical_allreduce": "ignored: collectives go through torch.distributed (gloo/NCCL), "
                              "which picks its own algorithm",
    "hierarchical_allgather": "ignored: torch.distributed picks the allgather algorithm",
    "torus_allreduce": "ignored: torch.distributed picks the allreduce algorithm",
    "autotune_gaussian_process_noise": "ignored: the autotuner measures every distinct bucket "
                                       "layout (a grid), it fits no Gaussian process",
    "timeline_mark_cycles": f"ignored: {_NO_CYCLES}",
    "mpi_threads_disable": "ignored: hvd_trainer does not run MPI collectives (mpirun only starts processes)",
    "num_nccl_streams": "ignored: NCCL streams are chosen by torch.distributed",
    "thread_affinity": "ignored: hvd_trainer starts no background thread to pin",
    "log_without_timestamp": "ignored: hvdrun's own lines carry no timestamp",
    "log_hide_timestamp": "ignored: hvdrun's own lines carry no timestamp",
    "host_discovery_script": "not run: torchrun's rendezvous admits the hosts that start the same "
                             "hvdrun command. HINT: --min-np/--max-np with one hvdrun per host",
    "slots_per_host": "ignored: slots come from -H/--hostfile (torchrun runs the same count per host)",
    "blacklist_cooldown_range": "ignored: torchrun restarts every worker and blacklists no host",
}
"""Flag (argparse dest) -> why it has no effect under hvdrun (one line each)."""

SSH_NOTES: dict[str, str] = {
    "ssh_port": "ignored without --mpi or other hosts to start over ssh (-H, no --no-ssh)",
    "ssh_identity_file": "ignored without --mpi or other hosts to start over ssh (-H, no --no-ssh)",
}
"""ssh flags, honoured with ``--mpi`` (mpirun arguments) or other hosts (hvdrun's ssh), else noted."""

MPI_ONLY_NOTES: dict[str, str] = {
    "mpi_args": "ignored without --mpi",
    "tcp": "ignored without --mpi: gloo and torchrun's rendezvous use TCP already",
    "binding_args": "ignored without --mpi: torchrun does not bind processes",
}
"""Flags honoured with ``--mpi`` (as mpirun arguments) and noted without it."""



def add_horovod_flags(p: argparse.ArgumentParser) -> None:
    """Add horovodrun's remaining flags to ``p`` (defaults ``None``/``False``: not given)."""
    p.add_argument("-v", "--version", action="store_true", help="print hvdrun's version and exit")
    p.add_argument("--gloo", action="store_true", help="accepted: the default controller")
    p.add_argument("--jsrun", action="store_true", help="accepted with a note (not supported)")
    p.add_argument("--disable-cache", action="store_true", help="accepted, no effect")
    p.add_argument("--config-file", help="accepted with a note (not read)")
    p.add_argument("-p", "--ssh-port", type=int, help="sshd port of the other hosts (hvdrun's/mpirun's ssh)")
    p.add_argument("-i", "--ssh-identity-file", help="ssh private key for the other hosts")
    p.add_argument("--cache-capacity", type=int, help="accepted, no effect")
    for name in ("hierarchical-allreduce", "hierarchical-allgather", "torus-allreduce"):
        p.add_argument(f"--{name}", f"--no-{name}", action="store_true", help="accepted, no effect")
    p.add_argument("--autotune", action="store_true",
                   help="search the gradient bucket layout during the first steps (HOROVOD_AUTOTUNE=1)")
    p.add_argument("--autotune-log-file", help="CSV of every autotune sample (HOROVOD_AUTOTUNE_LOG)")
    for name in ("warmup-samples", "steps-per-sample", "bayes-opt-max-samples"):
        p.add_argument(f"--autotune-{name}", type=int,
                       help=f"exported as HOROVOD_AUTOTUNE_{name.upper().replace('-', '_')}")
    p.add_argument("--autotune-gaussian-process-noise", type=float, help="accepted, no effect")
    p.add_argument("--slots-per-host", type=int, help="accepted, no effect (slots come from -H)")
    p.add_argument("--elastic-timeout", type=float,
                   help="elastic: seconds a rendezvous waits, the first one included "
                        "(default: --start-timeout for the first, 600 for later ones)")
    p.add_argument("--blacklist-cooldown-range", type=int, nargs=2, help="accepted, no effect")
    p.add_argument("--host-discovery-script", help="accepted with a note (not run)")
    p.add_argument("--timeline-mark-cycles", action="store_true", help="accepted, no effect")
    p.add_argument("--no-stall-check", action="store_true", help="disable the stall check")
    p.add_argument("--stall-check-warning-time-seconds", type=float, help="stall warning after S seconds")
    p.add_argument("--stall-check-shutdown-time-seconds", type=float, help="stall error after S seconds")
    p.add_argument("--mpi-threads-disable", action="store_true", help="accepted, no effect")
    p.add_argument("--mpi-args", help="--mpi: extra mpirun arguments (one string)")
    p.add_argument("--tcp", action="store_true", help="--mpi: TCP transport for mpirun's own traffic")
    p.add_argument("--binding-args", help="--mpi: replaces '--bind-to none --map-by slot'")
    p.add_argument("--num-nccl-streams", type=int, help="accepted, no effect")
    p.add_argument("--thread-affinity", type=int, help="accepted, no effect")
    p.add_argument("--gloo-timeout-seconds", type=float,
                   help="several hosts: a peer silent S seconds is unreachable (default 10; 0: never)")
    p.add_argument("--log-level", choices=("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"),
                   help="exported as HOROVOD_LOG_LEVEL")
    p.add_argument("--log-without-timestamp", "--log-hide-timestamp", dest="log_without_timestamp",
                   action="store_true", help="accepted, no effect")
    p.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", dest="prefix_timestamp",
                   action="store_true", help="add a timestamp to every line's rank prefix")


def _given(ns: argparse.Namespace, dest: str) -> bool:
    value = getattr(ns, dest, None)
    return value is not None and value is not False


def flag_env(ns: argparse.Namespace) -> dict[str, str]:
    """Worker variables for the honoured flags of :data:`ENV_FLAGS` and ``--no-stall-check``."""
    env = {var: f"{getattr(ns, dest):g}" if isinstance(getattr(ns, dest), float) else str(getattr(ns, dest))
           for dest, var in ENV_FLAGS.items() if _given(ns, dest)}
    if ns.no_stall_check:
        env["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    if ns.autotune:
        env["HOROVOD_AUTOTUNE"] = "1"
    return env


def notes_for(ns: argparse.Namespace, ssh: bool = False) -> list[str]:
    """``hvdrun: note: --flag ...`` lines for the given flags that do not apply (``ssh``: hvdrun
    starts other hosts over ssh, so ``-p``/``-i`` apply)."""
    notes = dict(NOTES)
    if not ns.mpi:
        notes.update(MPI_ONLY_NOTES)
        if not ssh:
            notes.update(SSH_NOTES)
    return [f"hvdrun: note: --{dest.replace('_', '-')}: {why}." for dest, why in notes.items()
            if _given(ns, dest)]


def mpirun_extra_args(ns: argparse.Namespace) -> tuple[list[str] | None, list[str]]:
    """``(binding, extra)`` mpirun arguments for ``--binding-args`` (``None``: the default binding)
    and for ``-p``/``-i``/``--ssh-option``/``--tcp``/``--mpi-args`` (appended before the command)."""
    binding = shlex.split(ns.binding_args) if ns.binding_args else None
    extra: list[str] = []
    ssh = []
    if ns.ssh_port is not None:
        ssh += ["-p", str(ns.ssh_port)]
    if ns.ssh_identity_file:
        ssh += ["-i", ns.ssh_identity_file]
    for option in getattr(ns, "ssh_option", None) or []:
        ssh += ["-o", option]
    if ssh:
        extra += ["--mca", "plm_rsh_args", shlex.join(ssh)]
    if ns.tcp:
        extra += ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self,vader"]
    if ns.mpi_args:
        extra += shlex.split(ns.mpi_args)
    return binding, extra

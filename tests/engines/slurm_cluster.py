"""A single-node Slurm cluster in a temporary directory: munged, slurmctld and slurmd as root.

Everything lives under ``root`` (munge key made here, slurm.conf with this machine's host name
and free ports, state, spool, logs, PID files); clients find it through ``SLURM_CONF`` in
:attr:`SlurmCluster.env`. No cgroups (``proctrack/linuxproc``, ``task/none``), no accounting
database. :func:`local_slurm` starts the daemons, waits until the node is idle and stops every
daemon (and each job step it started) at the end, also on failure.

Needs Debian's ``slurm-wlm`` and ``munge`` and root; :func:`unavailable_reason` says why not.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hvd_trainer.comm.world.world import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scontrol", "sinfo", "squeue")


def unavailable_reason() -> str | None:
    """Why a local Slurm cluster cannot start here, or ``None`` when it can."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None
               and not Path("/usr/sbin", name).exists()]
    if missing:
        return f"Slurm/munge not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "the local Slurm cluster runs slurmd as root; tests run as a normal user"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class SlurmCluster:
    """A running cluster: ``env`` for clients (``SLURM_CONF``), ``node`` its one node's name."""

    root: Path
    node: str
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def logs(self) -> str:
        """The tail of each daemon's log (for failure messages)."""
        parts = []
        for log in sorted([*self.root.glob("*.log"), *self.root.glob("*.err")]):
            parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)


def _write_config(root: Path, node: str, cpus: int) -> Path:
    for sub in ("state", "spool"):
        (root / sub).mkdir(mode=0o700)
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=hvdtest",
        # Job ids (and so the master port 15000 + id % 10000 that hvd_trainer derives) differ
        # between clusters started at the same time by parallel test runs.
        f"FirstJobId={random.randrange(1000, 40000)}",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge.socket'}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/builtin",
        "ReturnToService=2",
        "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "SlurmdParameters=config_overrides",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
        "KillWait=5",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
        "",
    ]))
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    return conf


def _wait_idle(cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        for proc in cluster.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}\n{cluster.logs()}")
        out = subprocess.run([_binary("sinfo"), "-h", "-N", "-o", "%T"], env=cluster.env,
                             capture_output=True, text=True, timeout=20)
        state = out.stdout.strip()
        if state == "idle":
            return
        time.sleep(0.5)
    raise RuntimeError(f"the Slurm node is not idle after {timeout}s (state {state!r})\n{cluster.logs()}")


def _stop(cluster: SlurmCluster) -> None:
    subprocess.run([_binary("scancel"), "--user=root", "--full"], env=cluster.env,
                   capture_output=True, timeout=20, check=False)
    for proc in reversed(cluster.procs):  # slurmd, slurmctld, then munged
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def local_slurm(root: Path, cpus: int = 2, start_timeout: float = 60) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd (foreground, as children) under ``root``; stop them
    at the end. ``cpus``: CPUs the node offers (more than the machine has is allowed)."""
    node = socket.gethostname().split(".")[0]
    conf = _write_config(root, node, cpus)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = SlurmCluster(root=root, node=node, env=env)
    daemons = [
        [_binary("munged"), "-F", "--force", f"--socket={root / 'munge.socket'}",
         f"--key-file={root / 'munge.key'}", f"--pid-file={root / 'munged.pid'}",
         f"--log-file={root / 'munged.log'}", f"--seed-file={root / 'munged.seed'}"],
        [_binary("slurmctld"), "-D", "-i", "-f", str(conf)],
        [_binary("slurmd"), "-D", "-N", node, "-f", str(conf)],
    ]
    try:
        for argv in daemons:
            with open(root / f"{Path(argv[0]).name}.err", "w") as err:  # the child keeps its copy
                cluster.procs.append(subprocess.Popen(argv, env=env, cwd=root, stdout=subprocess.DEVNULL,
                                                      stderr=err))
            if argv[0].endswith("munged"):
                _wait_for(root / "munge.socket", cluster, timeout=20)
        _wait_idle(cluster, start_timeout)
        yield cluster
    finally:
        _stop(cluster)


def _wait_for(path: Path, cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or cluster.procs[-1].poll() is not None:
            raise RuntimeError(f"{path} did not appear\n{cluster.logs()}")
        time.sleep(0.1)

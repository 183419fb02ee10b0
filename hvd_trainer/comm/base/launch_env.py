"""What launched this process: torchrun, Open MPI / MPICH, Slurm, or nothing.

:func:`hvd_trainer.comm.world.world.detect_launch_env` is the one entry point; this module holds the
per-launcher readers it calls and the :class:`LaunchEnv` they return. Nothing here opens a
process group; the only side effects are the optional ``mpi4py`` exchange of the master
address (MPI without ``MASTER_ADDR``) and running ``scontrol show hostnames`` (Slurm).

Variables read, by launcher (first match wins, in this order):

* torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT`` (``TORCHELASTIC_RUN_ID`` marks an elastic agent).
* Kubeflow PyTorchJob pod, a process started by the pod's command itself (no torchrun: no
  ``LOCAL_RANK``, no ``TORCHELASTIC_RUN_ID``) where the operator set ``PET_NPROC_PER_NODE`` /
  ``PET_NNODES``: there ``RANK`` (= ``PET_NODE_RANK``) is the *pod's* index and ``WORLD_SIZE``
  is pods x ``PET_NPROC_PER_NODE``, so they are process ranks only with one process per pod
  (``launcher="pytorchjob"``, local rank 0 of 1). With several processes per pod, or an
  elastic ``PET_NNODES="1:4"``, the pod must start them with torchrun, which reads
  ``--nnodes``/``--nproc-per-node``/``--node-rank`` from the ``PET_*`` variables; anything else
  raises :class:`LaunchEnvError` instead of joining with wrong ranks.
* horovodrun (Gloo controller): ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``,
  ``HOROVOD_LOCAL_SIZE``, ``HOROVOD_CROSS_RANK``, ``HOROVOD_CROSS_SIZE`` (``HOROVOD_HOSTNAME``
  is informational). horovodrun's own rendezvous (``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``_PORT``)
  is an HTTP key-value server that ``torch.distributed`` cannot use, so the rendezvous is
  ``MASTER_ADDR``/``MASTER_PORT`` when exported, else (all ranks on one host) ``127.0.0.1`` and
  a port every rank derives from horovodrun's address and port.
* Open MPI: ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/``_LOCAL_SIZE``.
  MPICH / Intel MPI (Hydra, PMI): ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``,
  ``MPI_LOCALNRANKS``. The rendezvous address is ``MASTER_ADDR``/``MASTER_PORT`` when exported
  (``hvdrun --mpi`` does); otherwise rank 0's host name and a free port are broadcast with
  ``mpi4py`` when it is importable; otherwise, on a single node, ``127.0.0.1`` and a port
  derived from the MPI job id.
* Slurm (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, local size from
  ``SLURM_NTASKS_PER_NODE`` or ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE``
  (``"2(x3),1"`` form, indexed by ``SLURM_NODEID``). Master address: ``MASTER_ADDR`` or the
  first host of ``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST``/``SLURM_NODELIST``
  (``scontrol show hostnames`` when on ``PATH``, else :func:`expand_nodelist`). Master port:
  ``MASTER_PORT`` or ``15000 + SLURM_JOB_ID % 10000`` (Lightning's choice: below the
  kernel's ephemeral ports, 32768 and up, which another process's connection may hold). Jobs
  named ``bash``/``interactive`` (an ``salloc`` shell) are not treated as Slurm-launched, as
  in Lightning, nor is an ``sbatch`` script itself (``ENVIRONMENT=BATCH`` and no
  ``SLURM_STEP_ID``; its ``srun`` steps are).
* Lightning's script launcher (``python train.py`` with ``devices=N``): ``LOCAL_RANK`` and
  ``WORLD_SIZE`` without ``RANK``; :func:`lightning_script_view` gives the torchrun view of them
  (single node: global rank = local rank) without writing ``os.environ``.
* torchrun's elastic agent: ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``,
  ``TORCHELASTIC_MAX_RESTARTS``, read only by :func:`torchelastic_env`.

:func:`launcher_rank` is the global rank without any rendezvous (for "print on rank 0 only").
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "LaunchEnv",
    "LaunchEnvError",
    "TorchElasticEnv",
    "RecoveryEnv",
    "recovery_env",
    "RECOVERY_ENV",
    "expand_nodelist",
    "from_torchrun",
    "from_pytorchjob",
    "from_horovod",
    "from_mpi",
    "from_slurm",
    "launcher_rank",
    "lightning_script_view",
    "torchelastic_env",
    "worker_launcher",
]


class LaunchEnvError(ValueError):
    """The launcher's variables are malformed or insufficient; the message names them."""


@dataclass(frozen=True, slots=True)
class LaunchEnv:
    """Topology as reported by the launcher, before any process group exists."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "none"
    """Which launcher set the variables: ``"torchrun"``, ``"pytorchjob"``, ``"horovodrun"``,
    ``"mpi"``, ``"slurm"`` or ``"none"``."""
    cross_rank: int | None = None
    """Index of this host when the launcher says so (``HOROVOD_CROSS_RANK``); ``None``:
    derived as ``rank // local_size``."""
    cross_size: int | None = None
    """Number of hosts when the launcher says so (``HOROVOD_CROSS_SIZE``)."""


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError as exc:
                raise LaunchEnvError(
                    f"environment variable {name}={value!r} is not an integer. "
                    "HINT: unset it or launch with hvdrun/torchrun."
                ) from exc
    return None


def _in_pytorchjob_pod(env: Mapping[str, str]) -> bool:
    """The pod's own process in a Kubeflow PyTorchJob (not a torchrun worker inside the pod)."""
    return (("PET_NPROC_PER_NODE" in env or "PET_NNODES" in env)
            and "LOCAL_RANK" not in env and "TORCHELASTIC_RUN_ID" not in env)


def from_pytorchjob(env: Mapping[str, str]) -> LaunchEnv | None:
    """Topology of a process the pod's command started in a Kubeflow PyTorchJob, or ``None``
    when this is no such process (a torchrun worker inside the pod is read by
    :func:`from_torchrun`).

    Raises:
        LaunchEnvError: the pod runs several processes (``PET_NPROC_PER_NODE`` is not ``1``),
            ``PET_NNODES`` is an elastic range, or ``RANK``/``WORLD_SIZE`` are missing: only
            torchrun in the pod can give such processes their ranks.
    """
    if not _in_pytorchjob_pod(env):
        return None
    nproc, nnodes = env.get("PET_NPROC_PER_NODE", "1"), env.get("PET_NNODES", "")
    rank, size = _int(env, "PET_NODE_RANK", "RANK"), _int(env, "WORLD_SIZE")
    if nproc != "1" or (nnodes and not nnodes.isdigit()) or rank is None or size is None:
        raise LaunchEnvError(
            f"this process runs in a Kubeflow PyTorchJob pod (PET_NPROC_PER_NODE={nproc!r}, "
            f"PET_NNODES={nnodes!r}, RANK={env.get('RANK')!r}, WORLD_SIZE={env.get('WORLD_SIZE')!r}) "
            "but was not started by torchrun; RANK there is the pod's index, not a process rank. "
            "HINT: make the pod's command `torchrun --master-addr=$MASTER_ADDR "
            "--master-port=$MASTER_PORT train.py` (torchrun reads --nnodes, --nproc-per-node and "
            "--node-rank from PET_NNODES, PET_NPROC_PER_NODE and PET_NODE_RANK)."
        )
    return LaunchEnv(
        rank=rank, size=size, local_rank=0, local_size=1,
        master_addr=env.get("MASTER_ADDR") or None, master_port=_int(env, "MASTER_PORT"),
        launcher="pytorchjob",
    )


def from_torchrun(env: Mapping[str, str]) -> LaunchEnv | None:
    """Topology from torchrun's variables, or ``None`` when ``RANK``/``WORLD_SIZE`` are absent.

    A Kubeflow PyTorchJob pod's own process (``PET_*`` set, no torchrun agent) is read by
    :func:`from_pytorchjob` instead, since its ``RANK`` is the pod's index.

    Raises:
        LaunchEnvError: a malformed integer, or a PyTorchJob pod that needs torchrun.
    """
    pod = from_pytorchjob(env)
    if pod is not None:
        return pod
    rank = _int(env, "RANK")
    size = _int(env, "WORLD_SIZE")
    if rank is None or size is None:
        return None
    local_rank = _int(env, "LOCAL_RANK")
    local_size = _int(env, "LOCAL_WORLD_SIZE")
    return LaunchEnv(
        rank=rank,
        size=size,
        local_rank=rank if local_rank is None else local_rank,
        local_size=size if local_size is None else local_size,
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=_int(env, "MASTER_PORT"),
        launcher="torchrun",
    )


def from_horovod(env: Mapping[str, str]) -> LaunchEnv | None:
    """Topology from horovodrun's ``HOROVOD_*`` variables, or ``None`` when ``HOROVOD_RANK``/
    ``HOROVOD_SIZE`` are absent.

    Raises:
        LaunchEnvError: a malformed integer, or ranks on several hosts with no
            ``MASTER_ADDR``/``MASTER_PORT`` (horovodrun's HTTP rendezvous cannot serve
            ``torch.distributed``).
    """
    rank = _int(env, "HOROVOD_RANK")
    size = _int(env, "HOROVOD_SIZE")
    if rank is None or size is None:
        return None
    local_rank = _int(env, "HOROVOD_LOCAL_RANK")
    local_size = _int(env, "HOROVOD_LOCAL_SIZE")
    if local_rank is None or local_size is None:
        local_rank, local_size = rank, size
    addr, port = env.get("MASTER_ADDR") or None, _int(env, "MASTER_PORT")
    if size > 1 and (addr is None or port is None):
        if local_size != size:
            raise LaunchEnvError(
                f"horovodrun started {size} ranks on several hosts ({local_size} on this one) but "
                "MASTER_ADDR/MASTER_PORT are not set, and horovodrun's rendezvous server is not "
                "one torch.distributed can use. HINT: launch with `hvdrun -np N -H ...`, or "
                "export MASTER_ADDR=<host of rank 0> MASTER_PORT=<free port> to every rank."
            )
        job_key = (f"{env.get('HOROVOD_GLOO_RENDEZVOUS_ADDR', '')}:"
                   f"{env.get('HOROVOD_GLOO_RENDEZVOUS_PORT', '')}:{size}")
        addr, port = addr or "127.0.0.1", port or _derived_port(job_key)
    return LaunchEnv(
        rank=rank, size=size, local_rank=local_rank, local_size=local_size,
        master_addr=addr, master_port=port, launcher="horovodrun",
        cross_rank=_int(env, "HOROVOD_CROSS_RANK"), cross_size=_int(env, "HOROVOD_CROSS_SIZE"),
    )


# Cached so that repeated detection (Lightning's ClusterEnvironment, then init) runs the
# mpi4py broadcast - a collective - exactly once per process.
_MPI_RENDEZVOUS: tuple[str, int] | None = None


def _mpi4py_rendezvous() -> tuple[str, int] | None:
    """Rank 0's host name and a free port, broadcast over MPI; ``None`` without mpi4py."""
    global _MPI_RENDEZVOUS
    if _MPI_RENDEZVOUS is not None:
        return _MPI_RENDEZVOUS
    try:
        from mpi4py import MPI  # imported lazily: importing it initialises MPI
    except (ImportError, RuntimeError):
        return None
    comm = MPI.COMM_WORLD
    payload = None
    if comm.Get_rank() == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            payload = (socket.gethostname(), int(sock.getsockname()[1]))
    _MPI_RENDEZVOUS = comm.bcast(payload, root=0)
    return _MPI_RENDEZVOUS


def _derived_port(job_key: str, base: int = 20000, span: int = 20000) -> int:
    """A port every rank of one job computes identically from a job identifier string."""
    return base + zlib.crc32(job_key.encode()) % span


def _mpi_ranks(
    env: Mapping[str, str],
) -> tuple[int | None, int | None, int | None, int | None, str | None] | None:
    """``(rank, size, local_rank, local_size, job_key)`` of Open MPI or MPICH/PMI, or ``None``."""
    if "OMPI_COMM_WORLD_RANK" in env:
        return (_int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"),
                _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
                env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE"))
    if "PMI_RANK" in env:
        return (_int(env, "PMI_RANK"), _int(env, "PMI_SIZE"),
                _int(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
                _int(env, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"),
                env.get("PMI_KVSNAME") or env.get("PMI_ID"))
    return None


def from_mpi(env: Mapping[str, str]) -> LaunchEnv | None:
    """Topology from Open MPI or MPICH/PMI variables, or ``None`` when neither is present.

    Raises:
        LaunchEnvError: ``size > 1`` on several nodes with no ``MASTER_ADDR``/``MASTER_PORT``
            and no importable ``mpi4py`` to agree on one.
    """
    ranks = _mpi_ranks(env)
    if ranks is None:
        return None
    rank, size, local_rank, local_size, job_key = ranks
    if rank is None or size is None:
        raise LaunchEnvError(
            f"MPI rank variables are incomplete (rank={rank}, size={size}). "
            "HINT: start the job with mpirun/mpiexec, or unset OMPI_COMM_WORLD_*/PMI_* variables."
        )
    if local_rank is None or local_size is None:
        local_rank, local_size = rank, size
    addr, port = env.get("MASTER_ADDR") or None, _int(env, "MASTER_PORT")
    if size > 1 and (addr is None or port is None):
        found = _mpi4py_rendezvous()
        if found is not None:
            addr, port = addr or found[0], port or found[1]
        elif local_size == size and job_key:
            addr, port = addr or "127.0.0.1", port or _derived_port(job_key)
        else:
            raise LaunchEnvError(
                f"MPI job of size {size} but MASTER_ADDR={addr!r} MASTER_PORT={port!r} and mpi4py "
                "is not importable, so the ranks cannot agree on a rendezvous address. "
                "HINT: launch with `hvdrun --mpi`, export MASTER_ADDR/MASTER_PORT "
                "(mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<port>), or install mpi4py."
            )
    return LaunchEnv(
        rank=rank, size=size, local_rank=local_rank, local_size=local_size,
        master_addr=addr, master_port=port, launcher="mpi",
    )


_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _tasks_on_node(spec: str, node_id: int) -> int | None:
    """Tasks on node ``node_id`` from Slurm's ``"2(x3),1"`` notation; ``None`` if unparsable."""
    counts: list[int] = []
    for item in spec.split(","):
        match = _TASKS_ITEM.match(item.strip())
        if match is None:
            return None
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts[node_id] if 0 <= node_id < len(counts) else None


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(item: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.find("]", open_at)
    if close_at < 0:
        raise LaunchEnvError(f"unbalanced '[' in Slurm node list item {item!r}.")
    head, body, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    values: list[str] = []
    for rng in body.split(","):
        lo, _, hi = rng.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise LaunchEnvError(f"cannot parse range {rng!r} in Slurm node list item {item!r}.")
        width = len(lo)
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi or lo) + 1))
    return [head + value + tail for value in values for tail in _expand_one(rest)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list the way ``scontrol show hostnames`` does.

    ``"gpu[01-03,07],login1,rack[1-2]-n[1-2]"`` ->
    ``["gpu01", "gpu02", "gpu03", "gpu07", "login1", "rack1-n1", "rack1-n2", "rack2-n1",
    "rack2-n2"]``. Zero padding follows the width of the range's lower bound.

    Raises:
        LaunchEnvError: unbalanced brackets or a range that is not ``N`` or ``N-M``.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def _first_host(nodelist: str) -> str:
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass  # fall back to our own parser
    return expand_nodelist(nodelist)[0]


def _slurm_local_size(env: Mapping[str, str], size: int, local_rank: int) -> int:
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    if per_node.isdigit():
        return int(per_node)
    node_id = _int(env, "SLURM_NODEID") or 0
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        count = _tasks_on_node(env.get(name, ""), node_id)
        if count is not None:
            return count
    nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1
    return max(local_rank + 1, size // nodes)


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    """Inside an ``srun`` step. Not one: an ``salloc`` shell named bash/interactive, and an
    ``sbatch`` script itself (``ENVIRONMENT=BATCH`` without ``SLURM_STEP_ID``: Slurm sets
    ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS`` there, but it is a single process)."""
    if env.get("ENVIRONMENT") == "BATCH" and "SLURM_STEP_ID" not in env:
        return False
    return ("SLURM_PROCID" in env and "SLURM_NTASKS" in env
            and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"))


def from_slurm(env: Mapping[str, str]) -> LaunchEnv | None:
    """Topology from ``srun``'s variables, or ``None`` when not inside an ``srun`` step.

    Raises:
        LaunchEnvError: a malformed integer or node list.
    """
    if not _in_slurm_step(env):
        return None
    rank = _int(env, "SLURM_PROCID")
    size = _int(env, "SLURM_NTASKS")
    assert rank is not None and size is not None  # both keys checked above
    local_rank = _int(env, "SLURM_LOCALID") or 0
    local_size = _slurm_local_size(env, size, local_rank)
    addr = env.get("MASTER_ADDR") or None
    port = _int(env, "MASTER_PORT")
    if size > 1 and addr is None:
        nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                    or env.get("SLURM_NODELIST"))
        addr = _first_host(nodelist) if nodelist else "127.0.0.1"
    if size > 1 and port is None:
        job_id = _int(env, "SLURM_JOB_ID", "SLURM_JOBID") or 0
        port = 15000 + job_id % 10000  # never an ephemeral port another socket may hold
    return LaunchEnv(
        rank=rank, size=size, local_rank=local_rank, local_size=local_size,
        master_addr=addr, master_port=port, launcher="slurm",
    )


def worker_launcher(env: Mapping[str, str]) -> str | None:
    """Name of the launcher whose *worker* this process is, or ``None``.

    Used by ``hvdrun`` to refuse to run inside an already launched worker. Looks only at
    variables a launcher sets per worker process (not a Slurm batch script with one task).
    """
    if torchelastic_env(env).under_agent or (
        "RANK" in env and "WORLD_SIZE" in env and not _in_pytorchjob_pod(env)
    ):
        return "torchrun"  # a PyTorchJob pod's RANK/WORLD_SIZE describe pods, not this process
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        return "mpi"
    if "SLURM_STEP_ID" in env and env.get("SLURM_NTASKS", "1") not in ("", "1") \
            and "SLURM_PROCID" in env:
        return "slurm"
    return None


def lightning_script_view(env: Mapping[str, str]) -> dict[str, str] | None:
    """The torchrun view of Lightning's single-node self-launch variables, or ``None``.

    Lightning's script launcher (``python train.py`` with ``Trainer(devices=N)`` and no
    launcher) exports ``LOCAL_RANK`` and ``WORLD_SIZE`` but no ``RANK``. On one node the global
    rank is the local rank, so the view is ``env`` plus ``RANK=LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE=WORLD_SIZE`` (unless set). ``env`` itself is not modified: pass the view
    to :func:`~hvd_trainer.comm.world.world.detect_launch_env` / ``init(environ=...)``.

    Returns ``None`` when ``RANK`` is present or ``LOCAL_RANK``/``WORLD_SIZE`` is missing.
    """
    if "RANK" in env or "LOCAL_RANK" not in env or "WORLD_SIZE" not in env:
        return None
    view = dict(env)
    view["RANK"] = env["LOCAL_RANK"]
    view.setdefault("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])
    return view


def launcher_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's global rank as its launcher reported it; 0 when nothing launched it.

    Same precedence as :func:`~hvd_trainer.comm.world.world.detect_launch_env` (torchrun, then
    horovodrun, then Open MPI / MPICH, then Slurm; Lightning's self-launch counts as torchrun), but it reads
    only the rank variables: no rendezvous, no ``mpi4py``, no ``scontrol``. For "print on global
    rank 0 only" in a CLI, under every launcher.

    Raises:
        LaunchEnvError: a rank variable that is not an integer.
    """
    env = os.environ if env is None else env
    env = lightning_script_view(env) or env
    torchrun = from_torchrun(env)
    if torchrun is not None:
        return torchrun.rank
    horovod = _int(env, "HOROVOD_RANK")
    if horovod is not None:
        return horovod
    mpi = _mpi_ranks(env)
    if mpi is not None and mpi[0] is not None:
        return mpi[0]
    if _in_slurm_step(env):
        return _int(env, "SLURM_PROCID") or 0
    return 0


@dataclass(frozen=True, slots=True)
class TorchElasticEnv:
    """What torchrun's elastic agent tells its workers (all defaults outside an agent)."""

    under_agent: bool = False
    """``TORCHELASTIC_RUN_ID`` is set: an elastic agent started this process."""
    max_restarts: int = 0
    """``TORCHELASTIC_MAX_RESTARTS``: how often the agent may restart the workers."""
    restart_count: int = 0
    """``TORCHELASTIC_RESTART_COUNT``: 0 in the first attempt, then 1, 2, ..."""
    run_id: str = ""
    """``TORCHELASTIC_RUN_ID``; ``""`` outside an agent."""

    @property
    def unique_run_id(self) -> bool:
        """Whether ``run_id`` tells jobs apart (torchrun's static rendezvous calls every job
        ``"none"``)."""
        return self.run_id not in ("", "none")


def torchelastic_env(env: Mapping[str, str] | None = None) -> TorchElasticEnv:
    """Read torchrun's ``TORCHELASTIC_*`` variables (the one place that reads them).

    Raises:
        LaunchEnvError: ``TORCHELASTIC_MAX_RESTARTS``/``_RESTART_COUNT`` is not an integer.
    """
    env = os.environ if env is None else env
    return TorchElasticEnv(
        under_agent="TORCHELASTIC_RUN_ID" in env,
        max_restarts=_int(env, "TORCHELASTIC_MAX_RESTARTS") or 0,
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT") or 0,
        run_id=env.get("TORCHELASTIC_RUN_ID", ""),
    )


RECOVERY_ENV = "HVDRUN_RECOVERY"
"""How hvdrun's elastic job recovers from a lost worker: ``in-process`` or ``restart``."""
MIN_NP_ENV, MAX_NP_ENV = "HVDRUN_MIN_NP", "HVDRUN_MAX_NP"


@dataclass(frozen=True, slots=True)
class RecoveryEnv:
    """hvdrun's elastic settings as its workers see them (all defaults outside hvdrun)."""

    in_process: bool = False
    """``HVDRUN_RECOVERY=in-process``: survivors keep their processes and form a new group."""
    min_np: int = 1
    """``HVDRUN_MIN_NP``: the fewest workers the job trains with."""
    max_np: int = 0
    """``HVDRUN_MAX_NP``: launch slots that may exist (0: the launch's world size)."""
    settle_seconds: float = 2.0
    """``HVD_ELASTIC_SETTLE_SECONDS``: how long a membership round waits for a missing worker on
    another host before closing without it."""


def recovery_env(env: Mapping[str, str] | None = None) -> RecoveryEnv:
    """Read hvdrun's recovery variables (the one place that reads them).

    Raises:
        LaunchEnvError: ``HVDRUN_RECOVERY`` is neither ``in-process`` nor ``restart``, or a count
            is not an integer.
    """
    env = os.environ if env is None else env
    mode = env.get(RECOVERY_ENV, "restart")
    if mode not in ("in-process", "restart"):
        raise LaunchEnvError(f"{RECOVERY_ENV}={mode!r}: expected 'in-process' or 'restart'.")
    try:
        settle = float(env.get("HVD_ELASTIC_SETTLE_SECONDS", "2.0"))
    except ValueError as exc:
        raise LaunchEnvError(
            f"HVD_ELASTIC_SETTLE_SECONDS={env['HVD_ELASTIC_SETTLE_SECONDS']!r} is not a number"
        ) from exc
    return RecoveryEnv(in_process=mode == "in-process", min_np=_int(env, MIN_NP_ENV) or 1,
                       max_np=_int(env, MAX_NP_ENV) or 0, settle_seconds=settle)

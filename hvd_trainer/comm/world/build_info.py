"""What this installation can run and what this job uses: Horovod's ``*_built`` / ``*_enabled``
queries, answered for hvd_trainer on ``torch.distributed``.

"Built" facts describe the installed torch (and mpi4py), not a compiled extension of ours:
hvd_trainer has none, so its NCCL, gloo, CUDA and ROCm support is exactly torch's. "Enabled"
facts describe the running job. ``hvdrun --check-build`` prints the same probes
(:mod:`hvd_trainer.launch.check_build`). Nothing here initialises a transport.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from hvd_trainer.comm.base.errors import CommValueError
from hvd_trainer.comm.world.world import detect_launch_env, get_world, is_initialized

__all__ = [
    "gloo_built", "nccl_built", "nccl_version", "mpi_built", "mpi4py_installed", "cuda_built",
    "rocm_built", "ddl_built", "ccl_built", "mpi_enabled", "gloo_enabled", "mpi_threads_supported",
    "is_homogeneous",
]

MPI_PROBE_TIMEOUT_SECONDS = 60.0
"""Longest the one-off MPI library probe of :func:`mpi_built` may take (it runs in a child)."""

# Launcher variables a probing child must not see: under mpirun it would try to join the job.
_LAUNCH_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "HYDRA_", "SLURM_")


def gloo_built() -> bool:
    """Whether torch was built with the gloo backend (CPU collectives)."""
    return bool(dist.is_available() and dist.is_gloo_available())


def nccl_version() -> tuple[int, ...] | None:
    """NCCL version as a tuple such as ``(2, 21, 5)``, or ``None`` when torch has no NCCL."""
    if not (dist.is_available() and dist.is_nccl_available() and torch.version.cuda is not None):
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build may report NCCL but lack the library
        return None
    return tuple(int(v) for v in version) if isinstance(version, tuple) else (int(version),)


def nccl_built() -> int:
    """NCCL support of the installed torch, as Horovod reports it: the NCCL version code
    (``major * 10000 + minor * 100 + patch``, e.g. ``22105`` for 2.21.5; truthy) when torch
    is a CUDA build with NCCL, else ``0``. Use it as a bool or compare with a code."""
    version = nccl_version()
    if version is None:
        return 0
    major, minor, patch = (*version, 0, 0)[:3]
    return major * 10000 + minor * 100 + patch


def cuda_built() -> bool:
    """Whether the installed torch is a CUDA build (``torch.version.cuda`` is set). Says
    nothing about GPUs being present: see ``torch.cuda.is_available()``."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether the installed torch is a ROCm build (``torch.version.hip`` is set)."""
    return getattr(torch.version, "hip", None) is not None


def ddl_built() -> bool:
    """Always ``False``: IBM DDL is not a transport of hvd_trainer."""
    return False


def ccl_built() -> bool:
    """Always ``False``: oneCCL is not a transport of hvd_trainer."""
    return False


def mpi4py_installed() -> bool:
    """Whether the ``mpi4py`` package is installed (found without importing it)."""
    return importlib.util.find_spec("mpi4py") is not None


@functools.lru_cache(maxsize=1)
def mpi_built() -> bool:
    """Whether MPI is usable from Python here: ``mpi4py`` imports and finds an MPI library.

    hvd_trainer never sends tensors over MPI; MPI serves ``hvdrun --mpi`` launches and user
    code. Importing ``mpi4py.MPI`` initialises MPI, so unless the caller already imported it
    the check runs once in a child process (about a second; cached afterwards), with the
    launcher's variables removed so the child never joins a running job.
    """
    if "mpi4py.MPI" in sys.modules:
        return True
    if not mpi4py_installed():
        return False
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    code = "from mpi4py import MPI; MPI.Get_library_version()"
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              timeout=MPI_PROBE_TIMEOUT_SECONDS, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def mpi_enabled() -> bool:
    """Whether this process was launched by MPI (``mpirun``/``hvdrun --mpi``: Open MPI or
    MPICH variables present). Works before :func:`~hvd_trainer.comm.session.init`.

    Raises:
        ValueError: the launcher's variables are malformed (see ``detect_launch_env``).
    """
    return detect_launch_env().launcher == "mpi"


def gloo_enabled() -> bool:
    """Whether the initialised job's main backend is gloo (``False`` before ``init()``).
    On an NCCL job CPU tensors still travel over a gloo side group; this stays ``False``."""
    return is_initialized() and get_world().backend == "gloo"


class MPINotEnabledError(CommValueError):
    """:func:`mpi_threads_supported` asked outside an MPI launch."""


def mpi_threads_supported() -> bool:
    """Whether MPI may be used from several threads next to hvd_trainer (Horovod's meaning:
    may the user mix in ``mpi4py``).

    hvd_trainer itself never calls MPI, so it cannot conflict with the user's MPI calls. The
    answer is therefore the MPI library's own thread level when this process already
    initialised MPI (``MPI.Query_thread() == MPI.THREAD_MULTIPLE``), else ``True``.

    Raises:
        MPINotEnabledError: not launched by MPI (Horovod raises ``ValueError`` here, too).
    """
    if not mpi_enabled():
        raise MPINotEnabledError(
            "mpi_threads_supported() needs an MPI launch, but this process was not started by "
            "mpirun. HINT: launch with `hvdrun --mpi ...` or check hvd.mpi_enabled() first."
        )
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized():
        return True
    return bool(mpi.Query_thread() == mpi.THREAD_MULTIPLE)


def is_homogeneous() -> bool:
    """Whether every node runs the same number of processes (equal ``local_size`` on all ranks).

    The ranks publish their ``local_size`` in the job's key-value store during ``init()``; the
    first call reads them (waiting for ranks still initialising) and caches the answer.

    Raises:
        NotInitializedError: before ``init()``.
    """
    world = get_world()
    runtime = world.runtime
    if world.size == 1 or runtime is None:
        return True
    return runtime.homogeneous()

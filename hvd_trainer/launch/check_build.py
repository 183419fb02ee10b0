"""``hvdrun --check-build``: what this installation can run (frameworks and transports)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

from hvd_trainer.comm import gloo_built, mpi4py_installed, nccl_version
from hvd_trainer.launch.commands import find_mpirun

__all__ = ["check_build_report"]


def _mark(ok: bool) -> str:
    return "[X]" if ok else "[ ]"


def _nccl_line() -> str:
    version = nccl_version()
    if version is None:
        return f"{_mark(False)} NCCL"
    return f"{_mark(True)} NCCL {'.'.join(str(v) for v in version)}"


def _keras_backends() -> list[str]:
    modules = {"tensorflow": "tensorflow", "torch": "torch", "jax": "jax"}
    found = [name for name, module in modules.items() if importlib.util.find_spec(module)]
    return found if importlib.util.find_spec("keras") else []


def _version(dist_name: str) -> str | None:
    """Installed version without importing (importing keras would start TensorFlow)."""
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_build_report() -> str:
    """A Horovod ``--check-build``-style report; checks only, never initialises a transport."""
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    keras_version = _version("keras")
    backends = _keras_backends()
    mpirun = find_mpirun()  # what hvdrun --mpi runs: PATH, then next to this Python
    lines = [
        "hvd_trainer build check",
        "",
        "Frameworks:",
        f"    {_mark(True)} PyTorch {torch.__version__}",
        f"    {_mark(keras_version is not None)} Keras {keras_version or ''}".rstrip()
        + (f" (backends installed: {', '.join(backends)})" if backends else ""),
        "",
        "Devices:",
        f"    {_mark(cuda)} CUDA ({count} device{'s' if count != 1 else ''})",
        "",
        "Transports:",
        f"    {_mark(gloo_built())} gloo",
        f"    {_nccl_line()}",
        f"    {_mark(mpirun is not None)} MPI launcher (mpirun"
        + (f": {mpirun})" if mpirun else " neither on PATH nor next to this Python)"),
        f"    {_mark(mpi4py_installed())} mpi4py",
    ]
    return "\n".join(lines)

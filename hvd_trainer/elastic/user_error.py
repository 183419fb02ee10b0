"""Tell hvdrun that a worker failed by its own exception, so the job is not restarted.

torchrun's elastic agent restarts every worker after *any* failure. Horovod restarts only what
a peer caused (``HorovodInternalError``: a collective failed because another rank died, and
``HostsUpdatedInterrupt``); a deterministic exception of the user's code would fail the same way
in every attempt. So :func:`run` and the Lightning strategy's elastic fit classify the exception
that ends the training function with :func:`is_peer_failure`; for anything else they call
:func:`record_user_error`, which writes ``user_error.<rank>.json`` into the job directory that
hvdrun exports as ``HVDRUN_JOB_DIR``. hvdrun's agent watch (:mod:`hvd_trainer.launch.agent_watch`,
which reads the same file format) then stops the workers instead of restarting them and ends
with the worker's exit status and the exception's text.

Without ``HVDRUN_JOB_DIR`` (plain torchrun, mpirun) nothing is written.

File format (JSON): ``{"rank": int, "type": str, "message": str, "exit_code": int}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from hvd_trainer.comm import HorovodInternalError, HostsUpdatedInterrupt, StallError, peer_failed

__all__ = ["JOB_DIR_ENV", "is_peer_failure", "record_user_error", "user_error_path"]

JOB_DIR_ENV = "HVDRUN_JOB_DIR"
"""Variable hvdrun sets to the job directory (one per hvdrun invocation, shared by attempts)."""

_PEER_ERRORS: tuple[type[BaseException], ...] = (
    HorovodInternalError, HostsUpdatedInterrupt, StallError, dist.DistError,
)
"""A peer died or stalled, or the transport failed: restarting can help."""


_TRANSPORT_MESSAGES = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "nccl communicator",
    "connection refused", "socket timeout", "gloo/transport",
)
"""Text of the ``RuntimeError`` gloo/NCCL raise when a peer's process is gone (a collective that
did not go through hvd_trainer's comm layer, e.g. one of Lightning's or torch's own)."""


def _transport_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _TRANSPORT_MESSAGES)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is one a restart can cure: one of
    Horovod's peer errors, torch's ``DistError``, or a gloo/NCCL transport ``RuntimeError``.

    Also true for any ``exc`` once this process's comm layer raised a peer's failure in its
    current world (:func:`~hvd_trainer.comm.base.fatal.peer_failed`; in-process recovery clears
    it): what ends the function then follows from that failure even where a framework
    re-raised it as its own type without the chain. TensorFlow does: an exception inside
    ``tf.numpy_function`` (the Keras ``DistributedOptimizer``'s allreduce) reaches ``fit``'s
    caller as ``tf.errors.UnknownError`` carrying only its text."""
    if peer_failed():
        return True
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, _PEER_ERRORS) or _transport_failure(current):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def user_error_path(job_dir: str | os.PathLike[str], rank: int) -> Path:
    """``<job_dir>/user_error.<rank>.json``."""
    return Path(job_dir) / f"user_error.{rank}.json"


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "0")))


def record_user_error(exc: BaseException, *, exit_code: int = 1, rank: int | None = None) -> Path | None:
    """Record ``exc`` for hvdrun unless it is a peer failure; return the file written, if any.

    Args:
        exc: the exception that ends this worker.
        exit_code: the status the worker will exit with (an uncaught exception: 1).
        rank: this worker's global rank (default: the process group's, else ``RANK``).
    """
    job_dir = os.environ.get(JOB_DIR_ENV)
    if not job_dir or is_peer_failure(exc):
        return None
    rank = _rank() if rank is None else rank
    path = user_error_path(job_dir, rank)
    record = {"rank": rank, "type": type(exc).__name__, "message": str(exc)[:2000], "exit_code": exit_code}
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)  # hvdrun never reads half a file
    except OSError:
        return None  # the job dir is gone (hvdrun ended): nothing left to tell
    return path

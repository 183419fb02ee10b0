"""Errors raised by the comm layer. Every message says what was received and how to fix it."""

from __future__ import annotations

__all__ = [
    "CommError",
    "CommValueError",
    "CommTypeError",
    "NotInitializedError",
    "CollectiveMismatchError",
    "StallError",
    "JoinedRankError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "RankFailedError",
    "HostUnreachableError",
    "JobSecretError",
]


class CommError(RuntimeError):
    """Base class for hvd_trainer communication errors."""


class CommValueError(ValueError):
    """A collective received an invalid argument (bad root rank, splits, process set...)."""


class CommTypeError(TypeError):
    """A collective received an argument of the wrong type (not a tensor, bool Average...)."""


class NotInitializedError(ValueError):
    """Raised when a collective or topology query runs before :func:`hvd_trainer.init`.

    A ``ValueError`` like Horovod's ``'Horovod has not been initialized; use hvd.init().'``.
    """

    def __init__(self, what: str = "this call") -> None:
        super().__init__(
            f"hvd_trainer has not been initialized, so {what} cannot run. "
            "HINT: call hvd_trainer.init() first (or use Trainer(strategy='horovod'))."
        )


class CollectiveMismatchError(CommError):
    """Ranks disagreed on a collective (op, name, shape, dtype, root, call order, ...).

    Raised on every rank, naming the tensor and listing each rank's value, instead of the
    hang or silent corruption the transport would otherwise produce.
    """


class StallError(CommError):
    """Some ranks did not reach a collective within the stall timeout; they are named."""


class JoinedRankError(CommError):
    """A collective other than allreduce ran while a rank had called :func:`join`."""


class HorovodInternalError(CommError):
    """Horovod's error for a failed collective, kept so ported ``except HorovodInternalError:``
    clauses stay valid.

    hvd_trainer raises it only as its subclass :class:`RankFailedError` (a collective failed
    because a peer died). Other failures raise :class:`CollectiveMismatchError`,
    :class:`StallError`, :class:`JoinedRankError` or torch's ``DistBackendError``, and elastic
    recovery restarts every worker through torchrun's agent (:mod:`hvd_trainer.elastic`) instead
    of catching an exception in-process.
    """


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's signal that hosts were added or removed during elastic training, kept so
    ported ``except HostsUpdatedInterrupt:`` clauses stay valid.

    With in-process recovery (``hvdrun --recovery in-process``) ``State.commit()`` raises it on
    every rank at the same commit when a restarted worker waits to join;
    :func:`hvd_trainer.elastic.run` catches it, re-forms the world with the joiner and calls the
    function again. (With the restart path the agent restarts all workers instead.)

    Args:
        skip_sync: Horovod's flag: the state need not be synced from rank 0 on reset.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__(f"hosts updated (skip_sync={skip_sync})")
        self.skip_sync = skip_sync


class RankFailedError(HorovodInternalError):
    """A collective failed because another rank is no longer running (crashed, exited or was
    killed); the message names the rank, its host and pid. The original transport error is
    chained as ``__cause__``."""


class HostUnreachableError(RankFailedError):
    """Ranks on another host have been silent for the peer timeout (``HOROVOD_GLOO_TIMEOUT_SECONDS``),
    or this rank cannot reach the job's store: the network between the hosts is cut or a host is
    down. The message names the unreachable host(s) and their ranks
    (:mod:`hvd_trainer.comm.world.heartbeat`)."""


class JobSecretError(CommError):
    """A rank did not prove at init that it holds the job's secret (``HOROVOD_SECRET_KEY``):
    a process that does not belong to the job reached its rendezvous. The message names it
    (:mod:`hvd_trainer.comm.world.membership`)."""

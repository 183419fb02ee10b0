"""Errors raised by the comm layer. Every message says what was received and how to fix it."""

from __future__ import annotations

__all__ = ["CommError", "NotInitializedError", "CollectiveMismatchError"]


class CommError(RuntimeError):
    """Base class for hvd_trainer communication errors."""


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
    """Ranks disagreed on a collective (op, name, shape, dtype, root, ...).

    Raised on every rank, naming the tensor and listing each rank's value, instead of the
    hang or silent corruption the transport would otherwise produce.
    """

"""Handles of asynchronous collectives: :class:`Handle`, :func:`poll` and :func:`synchronize`.

Every ``*_async`` collective returns a :class:`Handle` made of *parts* (launched transport calls:
an :class:`~hvd_trainer.comm.ops.reduce.Reduction`, a :class:`Launched` call, or another handle) and a
``finish`` function that turns the completed parts into the result. The blocking collectives are
the async ones followed by :meth:`Handle.wait`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from hvd_trainer.comm.base.errors import CommTypeError
from hvd_trainer.comm.ops.checks import Op
from hvd_trainer.comm.ops.process_set import ProcessSet

__all__ = ["Handle", "Launched", "poll", "synchronize"]


class Part(Protocol):
    """What a :class:`Handle` waits on."""

    def poll(self) -> bool: ...

    def finish(self) -> Any: ...


class Launched:
    """A launched transport call of one checked collective (what a Handle waits on).

    Args:
        pset: the process set the collective runs on.
        op: the collective, as returned by the set's ``coordinator.begin``.
        work: the ``torch.distributed`` work object (``None``: nothing to wait for).
    """

    __slots__ = ("pset", "op")

    def __init__(self, pset: ProcessSet, op: Op, work: Any) -> None:
        self.pset, self.op = pset, op
        pset.coordinator.launched(op, work)

    def poll(self) -> bool:
        """True when the transport has completed (never blocks)."""
        return self.op.done or self.op.work is None or bool(self.op.work.is_completed())

    def finish(self) -> None:
        """Wait for completion, inspecting for joins, mismatches and stalls meanwhile."""
        self.pset.coordinator.wait(self.op)


class Handle:
    """An asynchronous collective. Pass it to :func:`poll` or :func:`synchronize`.

    Calling it (``handle()``) is :func:`synchronize` too, which is how Horovod's
    ``sparse_allreduce_async`` handles are used.

    Args:
        parts: the launched calls to wait for, in order.
        finish: builds the result once every part has finished.
    """

    __slots__ = ("_parts", "_finish", "_result", "_done")

    def __init__(self, parts: Sequence[Part], finish: Callable[[], Any]) -> None:
        self._parts = list(parts)
        self._finish = finish
        self._result: Any = None
        self._done = False

    def poll(self) -> bool:
        """True when the result is ready (never blocks)."""
        return self._done or all(p.poll() for p in self._parts)

    def wait(self) -> Any:
        """Block until done and return the result (idempotent)."""
        if not self._done:
            for part in self._parts:
                part.finish()
            self._result = self._finish()
            self._done = True
        return self._result

    finish = wait  # a Handle can be a part of another Handle
    __call__ = wait


def poll(handle: Handle) -> bool:
    """Whether the async collective behind ``handle`` has completed (never blocks)."""
    return _handle(handle).poll()


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle`` and return its result tensor (or list of tensors).

    Raises:
        CollectiveMismatchError, StallError, JoinedRankError: found while waiting.
    """
    return _handle(handle).wait()


def _handle(handle: Any) -> Handle:
    if not isinstance(handle, Handle):
        raise CommTypeError(
            f"expected a Handle from an *_async call, got {type(handle).__name__}. "
            "HINT: h = allreduce_async(t); result = synchronize(h)."
        )
    return handle

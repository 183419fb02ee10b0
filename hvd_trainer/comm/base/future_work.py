"""A ``torch.distributed`` ``Work``-like handle over a ``concurrent.futures.Future``: for
transfers that a helper thread carries out or waits for (hierarchical allreduce, ZeRO's
point-to-point transfers).

``wait(timeout)`` raises ``RuntimeError("<what>: wait timed out")`` when the future is not done
in time, as gloo's own work does, so the comm layer's stall inspection (a dead or slow peer,
then wait again) treats both alike; an exception raised on the helper thread is raised here.
"""

from __future__ import annotations

import concurrent.futures
from datetime import timedelta

__all__ = ["FutureWork"]


class FutureWork:
    """``is_completed()`` / ``wait(timeout)`` over ``future``; ``what`` names it in errors."""

    def __init__(self, future: concurrent.futures.Future, what: str) -> None:
        self._future = future
        self._what = what

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            self._future.result(None if timeout is None else timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"{self._what}: wait timed out") from None
        return True

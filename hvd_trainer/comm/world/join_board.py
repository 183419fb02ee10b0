"""The store protocol behind :func:`~hvd_trainer.comm.ops.collectives.join` (uneven inputs, Horovod
semantics), over the job's key-value store.

A rank that has run out of data calls ``join()``. Until every rank of the set has joined:

* the other ranks keep calling allreduce (directly, grouped, or through the gradient reducer);
  each such collective is *announced* in the store as the list of transport allreduces it
  issues (element count, dtype, op);
* the joined rank reads each announcement in order and takes part with the op's identity
  element (0 for Sum/Average, so a joined rank contributes zeros; +max / -max for Min / Max;
  1 for Product). ``Average`` still divides by the full set size, as in Horovod;
* any other collective (allgather, broadcast, alltoall, reducescatter, barrier, objects) raises
  :class:`JoinedRankError` on the calling rank only, as in Horovod; the joined rank skips it
  (it was announced as an error, so both sides count it and stay in step) and its ``join()``
  keeps serving until every rank has joined.

Active ranks start announcing once they know somebody joined: before each collective when
they already know, otherwise the first time a wait on a collective lasts 50 ms
(``checks.JOIN_CHECK_AFTER_SECONDS``; the joined rank is missing from it, so it cannot finish),
at which point every collective still in flight is announced. Nothing is read from the store
while no rank has joined.

``join()`` returns the rank that joined last (the same value on every rank).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["JoinBoard", "Transport"]

Transport = tuple[int, str, str, str]
"""One transport allreduce of a collective: (element count, dtype name, op name, device type)."""


class JoinBoard:
    """Store keys of the join protocol for one process set."""

    def __init__(self, store: Any, prefix: str, rank: int, ranks: Sequence[int]) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.ranks = tuple(ranks)
        self.round = 0
        self.active = False
        """True once this rank knows some rank joined in the current round."""

    def _k(self, *parts: object) -> str:
        return "/".join([self.prefix, "j", str(self.round), *map(str, parts)])

    def started(self) -> bool:
        """Whether any rank has joined in this round (one store round trip)."""
        return bool(self.store.check([self._k("any")]))

    def joined_ranks(self) -> set[int]:
        """Ranks that have joined in this round."""
        return {q for q in self.ranks if self.store.check([self._k("r", q)])}

    def announce(self, seq: int, transports: Sequence[Transport] | None, error: str = "") -> None:
        """Tell joined ranks what collective ``seq`` needs (or that it is an error)."""
        payload = {"error": error} if error else {"t": [list(t) for t in transports or ()]}
        self.store.set(f"{self.prefix}/a/{seq}", json.dumps(payload))

    def serve(
        self,
        seq: int,
        run: Callable[[Transport], None],
        on_idle: Callable[[float], None],
    ) -> tuple[int, int]:
        """Join at collective index ``seq``; serve announced collectives until all ranks joined.

        Args:
            seq: this rank's next collective index.
            run: performs one transport allreduce with the identity element and waits.
            on_idle: called with the seconds waited so far while nothing is announced (stall
                inspection).

        Returns:
            ``(last_rank_to_join, next_seq)``.

        A collective announced as an error (one that cannot run with joined ranks) raised on
        the rank that called it; here it is only counted.
        """
        self.store.set(self._k("r", self.rank), str(seq))
        count = int(self.store.add(self._k("n"), 1))
        if count == len(self.ranks):
            self.store.set(self._k("last"), str(self.rank))
        self.store.set(self._k("any"), "1")
        idle_since, pause = time.monotonic(), 1e-4
        while True:
            key = f"{self.prefix}/a/{seq}"
            if self.store.check([key]):
                self._serve_one(json.loads(self.store.get(key)), run)
                seq += 1
                idle_since, pause = time.monotonic(), 1e-4
                continue
            final = self._final_seq()
            if final is not None and seq >= final:
                break
            on_idle(time.monotonic() - idle_since)
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)
        last = int(self.store.get(self._k("last")))
        self.round += 1
        self.active = False
        return last, seq

    def _final_seq(self) -> int | None:
        if int(self.store.add(self._k("n"), 0)) < len(self.ranks):
            return None
        return max(int(self.store.get(self._k("r", q))) for q in self.ranks)

    def _serve_one(self, payload: dict, run: Callable[[Transport], None]) -> None:
        if payload.get("error"):
            return  # raised on the caller only; nothing to take part in
        for numel, dtype, op, device in payload["t"]:
            run((int(numel), str(dtype), str(op), str(device)))

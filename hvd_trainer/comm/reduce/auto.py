"""``compression="auto"`` / ``sync_every="auto"``: choose the slow-link mode from the measured link
and the step's measured compute.

Rule (:func:`decide`), with ``t`` the time one fp32 allreduce of the model's gradients takes on
the measured link (:mod:`hvd_trainer.comm.reduce.link_probe`: ``latency + bytes / bandwidth``)
and ``c`` the step's compute time (wall time between optimizer steps less the time the step
waited on communication, median of the first measured steps, the slowest rank's):

1. every rank on one host (loopback or shared memory): plain allreduce, no probe, chosen at once;
2. ``t <= c / 2``: plain allreduce. The buckets overlap backward, about two thirds of ``c``;
   half of ``c`` leaves room for the wire's jitter and the last bucket, which nothing covers;
3. ``t / 2 <= c / 2``: ``bf16`` (half the bytes, no state);
4. otherwise, for ``compression="auto"``: ``powersgd`` of the default rank
   (:data:`~hvd_trainer.comm.ops.compression.DEFAULT_POWERSGD_RANK`) and its default synchronous
   warm-up (counted from the choice); for ``sync_every="auto"``:
   local steps with ``H`` the power of two
   (at most 128) that keeps the blocking outer allreduce under a fifth of the period's compute,
   ``t / H <= c / 5`` (so at least ~0.83 of the time computes).

:class:`AutoMode` runs it for a front end: on one host it decides when built; across hosts the
front end trains synchronously with plain allreduce (what it would run without ``"auto"``) for
``skip_steps + measure_steps`` optimizer steps while :class:`AutoMode` times them, then probes the
link (a collective), agrees on the compute (the slowest rank's) and decides, at the same step on
every rank. Rank 0 prints one line with the choice and why (:func:`announce`), the same from every
front end.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from hvd_trainer.comm.ops.compression import AUTO, DEFAULT_POWERSGD_RANK, Compression, Compressor
from hvd_trainer.comm.ops.ops import ReduceOp
from hvd_trainer.comm.ops.process_set import ProcessSet
from hvd_trainer.comm.ops.reduce import start_allreduce
from hvd_trainer.comm.reduce.link_probe import LinkEstimate, probe_link
from hvd_trainer.comm.world.world import World

__all__ = ["AUTO", "AutoChoice", "AutoMode", "announce", "decide"]

MAX_AUTO_SYNC_EVERY = 128
OUTER_SHARE = 0.2
"""Local steps: the largest share of a period's compute the blocking outer allreduce may take."""
DEFAULT_SKIP_STEPS = 2
"""Optimizer steps not timed (the first builds the buckets and warms the allocator up)."""
DEFAULT_MEASURE_STEPS = 5
"""Optimizer steps timed; their median compute is the ``c`` of the rule."""

Rule = Callable[[LinkEstimate | None, int, float], "AutoChoice"]
"""``(link, grad_bytes, compute_s) -> AutoChoice`` (``link=None``: every rank on one host)."""


@dataclass(frozen=True)
class AutoChoice:
    """What auto mode chose, and why (one line for rank 0)."""

    compression: Compressor
    sync_every: int | None
    reason: str

    def line(self, asked: dict[str, bool]) -> str:
        """The announcement: ``hvd_trainer: compression=auto chose compression=bf16: <reason>.``

        Args:
            asked: ``{"compression": bool, "sync_every": bool}``, which settings were ``"auto"``
                (only those are named, and only their choices).
        """
        names = [name for name in ("compression", "sync_every") if asked.get(name)]
        chosen = []
        if asked.get("compression"):
            chosen.append(f"compression={self.compression.name}")
        if asked.get("sync_every"):
            chosen.append(f"sync_every={self.sync_every}" if self.sync_every is not None
                          else "no local steps")
        return (f"hvd_trainer: {' and '.join(f'{n}=auto' for n in names)} chose "
                f"{', '.join(chosen)}: {self.reason}.")


def decide(link: LinkEstimate | None, grad_bytes: int, *, local_steps: bool, compute_s: float) -> AutoChoice:
    """The rule of the module docstring.

    Args:
        link: the measured link; ``None`` means every rank is on one host.
        grad_bytes: bytes of one fp32 copy of the gradients that would be reduced.
        local_steps: whether local steps may be chosen (``sync_every="auto"``), else PowerSGD.
        compute_s: the step's compute time, seconds (ignored when ``link`` is ``None``).
    """
    if link is None:
        return AutoChoice(Compression.none, None, "all ranks on one host: plain allreduce")
    t = link.latency_s + grad_bytes / link.bytes_per_s
    c = max(compute_s, 1e-6)
    measured = (f"one fp32 allreduce of {grad_bytes / 2**20:.2f} MiB takes {t:.3f} s "
                f"({link.bytes_per_s * 8 / 1e6:.0f} Mbit/s, {link.latency_s * 1e3:.1f} ms latency), "
                f"a step computes {c:.3f} s")
    if t <= c / 2:
        return AutoChoice(Compression.none, None, f"{measured}: plain allreduce, hidden behind backward")
    if t / 2 <= c / 2:
        return AutoChoice(Compression.bf16, None, f"{measured}: bf16 halves the bytes to hide them")
    if local_steps:
        h = min(MAX_AUTO_SYNC_EVERY, 2 ** max(0, math.ceil(math.log2(t / (OUTER_SHARE * c)))))
        return AutoChoice(Compression.none, h, f"{measured}: local steps, an outer step every {h} steps")
    return AutoChoice(Compression.powersgd(rank=DEFAULT_POWERSGD_RANK), None,
                      f"{measured}: PowerSGD rank {DEFAULT_POWERSGD_RANK}")


def announce(world: World, choice: AutoChoice, asked: dict[str, bool]) -> str:
    """Print :meth:`AutoChoice.line` on global rank 0 (stdout, flushed), the same line from every
    front end (torch ``DistributedOptimizer`` and ``LocalSGD``, Lightning strategy, Keras);
    returns the line."""
    line = choice.line(asked)
    if world.rank == 0:
        print(line, flush=True)
    return line


class AutoMode:
    """Resolves ``"auto"`` for one front end (the module docstring's schedule).

    The front end builds it when it knows the gradients' size, wraps its waits on gradient
    communication in :meth:`waiting` and calls :meth:`step_end` after every optimizer step; while
    :attr:`choice` is ``None`` it trains with plain allreduce. Every rank must build it and call
    :meth:`step_end` equally often (the step that decides is a collective over ``pset``).

    Args:
        world: the world at construction (one host: decided here, announced on rank 0).
        pset: the ranks that reduce the gradients (probe and agreement run over them).
        device: where the probe's tensors live (the gradients' device).
        grad_bytes: bytes of one fp32 copy of the gradients to reduce.
        asked: which settings are ``"auto"``: ``{"compression": bool, "sync_every": bool}``
            (``sync_every`` lets the rule choose local steps).
        skip_steps: optimizer steps not timed (>= 0).
        measure_steps: optimizer steps timed (>= 1).
        rule: ``(link, grad_bytes, compute_s) -> AutoChoice``; default :func:`decide`.
        clock: monotonic seconds (``time.perf_counter``).

    Raises:
        ValueError: ``skip_steps < 0`` or ``measure_steps < 1``.
    """

    def __init__(self, world: World, pset: ProcessSet, device: torch.device, grad_bytes: int, *,
                 asked: dict[str, bool], skip_steps: int = DEFAULT_SKIP_STEPS,
                 measure_steps: int = DEFAULT_MEASURE_STEPS, rule: Rule | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if skip_steps < 0 or measure_steps < 1:
            raise ValueError(f"AutoMode needs skip_steps >= 0 and measure_steps >= 1, got "
                             f"{skip_steps} and {measure_steps}")
        self._pset, self._device, self._grad_bytes, self._asked = pset, device, grad_bytes, asked
        self._skip, self._measure, self._clock = skip_steps, measure_steps, clock
        local = bool(asked.get("sync_every"))
        self._rule: Rule = rule or (
            lambda link, nbytes, c: decide(link, nbytes, local_steps=local, compute_s=c))
        self._steps, self._waited = 0, 0.0
        self._last: float | None = None
        self._compute: list[float] = []
        self.choice: AutoChoice | None = None
        """The choice, once made (``None`` while measuring)."""
        if world.cross_size == 1:
            self.choice = decide(None, grad_bytes, local_steps=local, compute_s=0.0)
            announce(world, self.choice, asked)

    @property
    def measuring(self) -> bool:
        """Whether the choice is still to be made."""
        return self.choice is None

    def adopt(self, choice: AutoChoice) -> None:
        """Take ``choice`` without measuring (a resumed run restores what an earlier run chose);
        nothing is printed."""
        self.choice = choice

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Time spent inside is waiting on communication, not compute."""
        start = self._clock()
        try:
            yield
        finally:
            self._waited += self._clock() - start

    @property
    def compute_samples(self) -> list[float]:
        """This rank's timed steps so far: compute seconds each."""
        return list(self._compute)

    def step_end(self, world: World) -> AutoChoice | None:
        """Count an optimizer step; at the last timed one, decide (a collective over ``pset``:
        the compute's maximum, then the link probe), announce on rank 0 of ``world`` and return
        the choice. Otherwise (and after deciding) ``None``."""
        if self.choice is not None:
            return None
        now = self._clock()
        self._steps += 1
        if self._last is not None and self._steps > self._skip:
            self._compute.append(max(0.0, now - self._last - self._waited))
        self._last, self._waited = now, 0.0
        if len(self._compute) < self._measure:
            return None
        agreed = torch.tensor([statistics.median(self._compute)], dtype=torch.float64, device=self._device)
        start_allreduce(agreed, op=ReduceOp.MAX, pset=self._pset, name="auto.compute",
                        kind="link_probe").finish()
        link = probe_link(self._pset, self._device)
        self.choice = self._rule(link, self._grad_bytes, float(agreed[0]))
        announce(world, self.choice, self._asked)
        return self.choice

"""``compression="auto"`` / ``sync_every="auto"``: choose the slow-link mode from the measured link.

Rule (:func:`decide`), with ``t`` the time one fp32 allreduce of the model's gradients takes on
the measured link (:mod:`hvd_trainer.comm.reduce.link_probe`: ``latency + bytes / bandwidth``)
and ``budget`` the communication time per step that is acceptable (``budget_seconds``, default
0.05 s):

1. every rank on one host (loopback or shared memory): plain allreduce, no probe;
2. ``t <= budget``: plain allreduce (a fast link; compression would only cost compute);
3. ``t / 2 <= budget``: ``bf16`` (half the bytes, no state);
4. otherwise, for ``compression="auto"``: ``powersgd`` of rank 16 (measured on the GPT recipe
   at 2 ranks, README "Slow links": rank 16 reached the synchronous loss at equal tokens, rank 4
   stayed on the loss plateau about 3x longer); for ``sync_every="auto"``:
   local steps with ``H`` the power of two (at most 128) that brings ``t / H`` under the budget.

The choice is the same on every rank (the probe's times are agreed across ranks first) and comes
with a one-line reason for rank 0 to print. The budget is a stand-in for the step's compute time,
which is not known when the reducer is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hvd_trainer.comm.ops.compression import AUTO, Compression, Compressor
from hvd_trainer.comm.ops.process_set import ProcessSet
from hvd_trainer.comm.reduce.link_probe import LinkEstimate, probe_link
from hvd_trainer.comm.world.world import World

__all__ = ["AUTO", "AutoChoice", "announce", "choose", "decide"]

DEFAULT_BUDGET_SECONDS = 0.05
MAX_AUTO_SYNC_EVERY = 128


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


def decide(link: LinkEstimate | None, grad_bytes: int, *, local_steps: bool,
           budget_seconds: float = DEFAULT_BUDGET_SECONDS) -> AutoChoice:
    """The rule of the module docstring; ``link=None`` means every rank is on one host."""
    if link is None:
        return AutoChoice(Compression.none, None, "all ranks on one host: plain allreduce")
    t = link.latency_s + grad_bytes / link.bytes_per_s
    measured = (f"one fp32 allreduce of {grad_bytes / 2**20:.1f} MiB takes {t:.3f} s "
                f"({link.bytes_per_s * 8 / 1e6:.0f} Mbit/s, {link.latency_s * 1e3:.1f} ms latency)")
    if t <= budget_seconds:
        return AutoChoice(Compression.none, None, f"{measured} <= {budget_seconds} s: plain allreduce")
    if t / 2 <= budget_seconds:
        return AutoChoice(Compression.bf16, None, f"{measured}; bf16 halves it under {budget_seconds} s")
    if local_steps:
        h = min(MAX_AUTO_SYNC_EVERY, 2 ** math.ceil(math.log2(t / budget_seconds)))
        return AutoChoice(Compression.none, h, f"{measured}; local steps, an outer step every {h} steps")
    return AutoChoice(Compression.powersgd(rank=16), None, f"{measured}; PowerSGD rank 16")


def announce(world: World, choice: AutoChoice, asked: dict[str, bool]) -> str:
    """Print :meth:`AutoChoice.line` on global rank 0 (stdout, flushed), the same line from every
    front end (torch ``DistributedOptimizer``, Lightning strategy, Keras); returns the line."""
    line = choice.line(asked)
    if world.rank == 0:
        print(line, flush=True)
    return line


def choose(world: World, pset: ProcessSet, device: torch.device, grad_bytes: int, *, local_steps: bool,
           budget_seconds: float = DEFAULT_BUDGET_SECONDS) -> AutoChoice:
    """Probe the link when the ranks span several hosts (a collective), then :func:`decide`."""
    link = probe_link(pset, device) if world.cross_size > 1 else None
    return decide(link, grad_bytes, local_steps=local_steps, budget_seconds=budget_seconds)

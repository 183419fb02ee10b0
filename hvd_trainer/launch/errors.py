"""The one error type of hvdrun's argument checks."""

from __future__ import annotations

__all__ = ["HvdrunError", "RendezvousEndedError", "RendezvousRefusedError",
           "RendezvousUnreachableError"]


class HvdrunError(ValueError):
    """Bad hvdrun arguments or environment; the message echoes the value and gives a ``HINT:``."""


class RendezvousRefusedError(RuntimeError):
    """hvdrun's agent was not let into the job listening on the rendezvous port: the job holds
    another secret or run id, or is already running with all its hosts
    (:mod:`hvd_trainer.launch.guarded_rdzv`). Nothing of the job was touched."""


class RendezvousUnreachableError(RuntimeError):
    """hvdrun's agent found no agent of its job hosting the rendezvous within the start timeout
    (:mod:`hvd_trainer.launch.guarded_rdzv`)."""


class RendezvousEndedError(RuntimeError):
    """The job's rendezvous closed (the job ended) while hvdrun's agent waited in it as a spare,
    before it was given a place in any world."""

"""The one error type of hvdrun's argument checks."""

from __future__ import annotations

__all__ = ["HvdrunError", "RendezvousRefusedError"]


class HvdrunError(ValueError):
    """Bad hvdrun arguments or environment; the message echoes the value and gives a ``HINT:``."""


class RendezvousRefusedError(RuntimeError):
    """hvdrun's agent was not let into the job listening on the rendezvous port: the job holds
    another secret or run id, or is already running with all its hosts
    (:mod:`hvd_trainer.launch.guarded_rdzv`). Nothing of the job was touched."""

"""The one error type of hvdrun's argument checks."""

from __future__ import annotations

__all__ = ["HvdrunError"]


class HvdrunError(ValueError):
    """Bad hvdrun arguments or environment; the message echoes the value and gives a ``HINT:``."""

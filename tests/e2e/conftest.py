"""Registers the session-scoped launches several e2e modules share (see shared_launches.py)."""

from __future__ import annotations

from tests.e2e.shared_launches import plain_probe, stamped_probe, verbose_timeline_probe

__all__ = ["plain_probe", "stamped_probe", "verbose_timeline_probe"]

"""Collect ``tests/dist``: pytest's default ``norecursedirs`` contains ``dist``, which would
otherwise skip the whole multi-process tier silently when running ``pytest tests``."""

from __future__ import annotations

from pathlib import Path

_DIST = Path(__file__).resolve().parent / "dist"


def pytest_ignore_collect(collection_path: Path, config: object) -> bool | None:
    if collection_path.resolve() == _DIST:
        return False  # collect it (first non-None answer wins over the norecursedirs default)
    return None

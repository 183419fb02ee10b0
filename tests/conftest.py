"""Collect tests/dist: pytest skips directories named ``dist`` by default (``norecursedirs``).

The lasting fix is ``norecursedirs`` in pyproject.toml; until then this hook, which runs before
pytest's own, keeps ``pytest tests`` running the multi-process tier.
"""

from __future__ import annotations

from pathlib import Path

_DIST = Path(__file__).resolve().parent / "dist"


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    if collection_path.resolve() == _DIST:
        return False
    return None

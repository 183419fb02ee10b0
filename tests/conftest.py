"""Tier markers: every test is marked with the folder it lives in (see tests/README.md).

``pytest -m unit``, ``pytest -m "dist or e2e"``, ``pytest -m "not multihost"`` select tiers
without naming paths.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = {
    "unit": "single process, no launcher: config, schedules, argument checks, small in-process worlds",
    "dist": "2-3 rank processes over gloo on loopback, kept between tests (tests/multiproc.py)",
    "e2e": "hvdrun / torchrun end to end: real launches, faults, recovery, examples",
    "engines": "Ray, Slurm, Spark, Kubernetes environment, each started by the test module",
    "multihost": "network-namespace hosts with veth links, sshd, tc shaping (root)",
    "gpu": "CUDA and NCCL paths; skipped without a GPU",
}
_HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    for name, text in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            tier = Path(item.fspath).resolve().relative_to(_HERE).parts[0]
        except ValueError:
            continue
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))

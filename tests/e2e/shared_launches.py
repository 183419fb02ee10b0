"""Launches shared by several e2e tests in different modules (registered by conftest.py).

Each hvdrun launch costs seconds of interpreter and rendezvous start-up, while many tests only
look at a few lines of one small job. These session-scoped fixtures run such a job once and
return its :class:`Result`; every test keeps its own assertions against it. A fixture is only
launched when a selected test asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.hvdrun_helpers import Result, clean_env, hvdrun

VARS_CODE = ("import os; print('VARS', *(os.environ[f'HOROVOD_{k}'] for k in ('RANK', 'SIZE', 'LOCAL_RANK', "
             "'LOCAL_SIZE', 'CROSS_RANK', 'CROSS_SIZE')), os.environ['HOROVOD_HOSTNAME'] != '')")
OMP_CODE = "import os; print('OMP', os.environ.get('OMP_NUM_THREADS'))"
# Each rank writes 200 lines in three unflushed pieces, with no pause: on a shared terminal the
# pieces of the two ranks would interleave.
LINES_CODE = ("import os, sys\nr = os.environ['RANK']\nfor i in range(200):\n"
              "    sys.stdout.write(f'line {i} '); sys.stdout.write('of rank ')\n"
              "    sys.stdout.write(r + '\\n')\n"
              "print('to stderr', r, file=sys.stderr)")
TIMELINE_CODE = "import torch, hvd_trainer as hvd; hvd.init(); hvd.allreduce(torch.ones(3), name='ones')"
PROBE_PREFIXES = ("VARS ", "OMP ")
"""What the plain probe prints besides the 200 lines (before them, one ``print`` each)."""


def _probe(*code: str) -> list[str]:
    """``python -c`` running the given snippets one after the other."""
    return ["python", "-c", "\n".join(code)]


def _env_without_omp() -> dict[str, str]:
    """The test environment without OMP_NUM_THREADS (hvdrun then picks the workers' value)."""
    env = clean_env()
    del env["OMP_NUM_THREADS"]
    return env


@pytest.fixture(scope="session")
def plain_probe() -> Result:
    """``hvdrun -np 2`` without OMP_NUM_THREADS: each rank prints its Horovod variables, its
    OMP_NUM_THREADS, then 200 lines written in pieces and one stderr line."""
    return hvdrun(["-np", "2", *_probe(VARS_CODE, OMP_CODE, LINES_CODE)], timeout=90, env=_env_without_omp())


@dataclass
class TimelineProbe:
    result: Result
    trace: Path
    """The --timeline-filename given to hvdrun."""


@pytest.fixture(scope="session")
def verbose_timeline_probe(tmp_path_factory: pytest.TempPathFactory) -> TimelineProbe:
    """``hvdrun -np 2 --verbose --timeline-filename`` without OMP_NUM_THREADS: each rank prints
    its OMP_NUM_THREADS, then allreduces a tensor named ``ones`` and ends without shutdown()."""
    trace = tmp_path_factory.mktemp("timeline") / "timeline.json"
    res = hvdrun(["-np", "2", "--verbose", "--timeline-filename", str(trace),
                  *_probe(OMP_CODE, TIMELINE_CODE)], timeout=120, env=_env_without_omp())
    return TimelineProbe(res, trace)


@pytest.fixture(scope="session")
def stamped_probe() -> Result:
    """``hvdrun -np 2 --prefix-output-with-timestamp`` with the user's OMP_NUM_THREADS=3: each
    rank prints its OMP_NUM_THREADS, then ``hi``."""
    return hvdrun(["-np", "2", "--prefix-output-with-timestamp", *_probe(OMP_CODE, "print('hi')")],
                  timeout=90, env=clean_env(OMP_NUM_THREADS="3"))

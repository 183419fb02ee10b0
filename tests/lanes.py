"""``make test``: the whole suite as four pytest runs side by side, then the 30 slowest tests.

* lane ``wait`` (``tests/multihost``, then ``tests/engines``): namespace hosts, cut links,
  heartbeat timeouts; Ray, Slurm, Spark and Kubernetes-style launches, each server started by its
  module. Mostly waiting, and at normal priority for two reasons: it holds the suite's tightest
  timing assertions (a survivor's next step within seconds of a fault), and the engines' own
  processes (Ray's GCS, raylet and worker actors, each importing torch; Slurm's daemons; Spark's
  JVM) inherit the lane's priority and run against the engines' own timeouts. The two tiers are
  one lane so that neither's bursts of start-up work land on the other's timing assertions.
* lane ``e2e`` (``tests/e2e``, ``tests/gpu``): hvdrun launches end to end, faults and recoveries
  with timing assertions of their own (a survivor's next step within 3 s); ``nice`` +5.
* lanes ``unit`` (``tests/unit``) and ``dist`` (``tests/dist``): one process, or rank pools
  computing values against closed forms, with no timing assertion tighter than minutes;
  ``nice`` +10, so they take the CPU the others leave idle. They are two lanes because one pytest
  process spends long stretches on one core (a test in one interpreter, a pool starting) while
  the waiting lanes leave the other idle.

One lane after the other, the suite keeps a 2-core machine about half idle (the waiting lanes'
tests sleep on a timeout or a link, a launch waits on its rendezvous); side by side, the suite
takes about as long as its longest lane, or its CPU time over the cores, whichever is more. The
lanes share nothing: the multihost tier's hosts are network namespaces of their own, every rank
pool and launch takes a fresh port, and every test its own temporary folder.

Usage: ``python -m tests.lanes [--reverse] [PYTEST_ARGS...]`` from the repository root; extra
arguments go to every pytest run. ``--reverse`` gives each lane its test files in reverse order
(the tests must not depend on order). Exit status: 0 when every lane passed, else the first
non-zero in :data:`LANES`' order; a lane where extra arguments selected nothing (pytest's 5)
counts as passed unless no lane ran a test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLOWEST = 30
NO_TESTS = 5  # pytest's exit status when nothing was selected


@dataclass(frozen=True, kw_only=True)
class Lane:
    """One pytest run: its folders under ``tests/`` and its ``nice`` increment."""

    name: str
    folders: tuple[str, ...]
    nice: int


LANES = (
    Lane(name="dist", folders=("dist",), nice=10),
    Lane(name="unit", folders=("unit",), nice=10),
    Lane(name="e2e", folders=("e2e", "gpu"), nice=5),
    Lane(name="wait", folders=("multihost", "engines"), nice=0),
)
STREAMED = "dist"
"""The lane whose output is shown as it runs; the others' logs are printed when all have ended."""


def _targets(lane: Lane, reverse: bool) -> list[str]:
    if not reverse:
        return [f"tests/{f}" for f in lane.folders]
    files = [p for f in lane.folders for p in (ROOT / "tests" / f).rglob("test_*.py")]
    return [str(p.relative_to(ROOT)) for p in sorted(files, reverse=True)]


def _start(lane: Lane, args: list[str], reverse: bool, junit: Path, log: Path | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pytest", "-q", *_targets(lane, reverse), f"--junitxml={junit}", *args]
    if lane.name != STREAMED:  # one lane keeps pytest's cache (last failures); two writers would race
        cmd += ["-p", "no:cacheprovider"]
    out = open(log, "w") if log is not None else None  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT if out else None,
                            preexec_fn=(lambda: os.nice(lane.nice)) if lane.nice else None)


def slowest(junit_files: list[Path], count: int = SLOWEST) -> list[tuple[float, str]]:
    """The ``count`` slowest test cases (seconds of setup + call + teardown, test id)."""
    cases = []
    for path in junit_files:
        if not path.exists():
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            test_id = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
            cases.append((float(case.get("time", 0.0)), test_id))
    return sorted(cases, reverse=True)[:count]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reverse", action="store_true", help="each lane's test files in reverse order")
    opts, pytest_args = parser.parse_known_args(argv)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvd-test-lanes-") as tmp:
        junits = {lane.name: Path(tmp) / f"{lane.name}.xml" for lane in LANES}
        logs = {lane.name: None if lane.name == STREAMED else Path(tmp) / f"{lane.name}.log"
                for lane in LANES}
        procs = {lane.name: _start(lane, pytest_args, opts.reverse, junits[lane.name], logs[lane.name])
                 for lane in LANES}
        try:
            codes = {name: proc.wait() for name, proc in procs.items()}
        except KeyboardInterrupt:
            for proc in procs.values():
                proc.terminate()
            raise
        for lane in LANES:
            log = logs[lane.name]
            if log is not None:
                print(f"\n========== lane {lane.name} ({', '.join(lane.folders)}) ==========", flush=True)
                print(log.read_text(), end="", flush=True)
        print(f"\n========== {SLOWEST} slowest tests, all lanes (setup + call + teardown) ==========")
        for seconds, test_id in slowest(list(junits.values())):
            print(f"{seconds:8.2f}s {test_id}")
    exits = ", ".join(f"{name} exit {code}" for name, code in codes.items())
    print(f"lanes: {exits}; {time.monotonic() - start:.1f} s in all (each lane's own time is on its "
          "pytest summary line)", flush=True)
    # 5: pytest selected no test in that lane (``-k`` naming tests of other lanes only)
    if all(c == NO_TESTS for c in codes.values()):
        return NO_TESTS
    return next((c for c in codes.values() if c not in (0, NO_TESTS)), 0)


if __name__ == "__main__":
    sys.exit(main())

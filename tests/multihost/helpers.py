"""Run hvdrun (or anything) on several namespace hosts at once and read what the ranks printed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.e2e.hvdrun_helpers import clean_env
from tests.multihost.netns import Cluster, Host

__all__ = ["HVDRUN", "SCRIPTS", "HostRun", "explain", "records", "run_on_hosts", "same_line"]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
HVDRUN = [sys.executable, "-c", "import sys; from hvd_trainer.launch.cli import main; sys.exit(main())"]
"""``hvdrun`` (the console script's code) with this interpreter."""


@dataclass
class HostRun:
    host: str
    returncode: int
    output: str
    seconds: float

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def explain(runs: list[HostRun]) -> str:
    """Every host's exit status and output tail, for assertion messages."""
    return "\n".join(f"--- {r.host}: rc={r.returncode} after {r.seconds:.1f} s ---\n{r.tail()}" for r in runs)


def run_on_hosts(hosts: list[Host], argv: list[str], *, timeout: float = 180.0,
                 env: dict[str, str] | None = None, cwd: str | None = None) -> list[HostRun]:
    """Start ``argv`` on every host at once, wait for all (a hang fails: AssertionError with the tails)."""
    env = env or clean_env()
    start = time.monotonic()
    procs = [h.popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for h in hosts]
    runs: list[HostRun] = []
    try:
        for host, proc in zip(hosts, procs, strict=True):
            left = max(1.0, timeout - (time.monotonic() - start))
            try:
                out, _ = proc.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                runs.append(HostRun(host.name, -9, out, time.monotonic() - start))
                msg = f"{host.name} did not finish within {timeout} s\n{explain(runs)}"
                raise AssertionError(msg) from None
            runs.append(HostRun(host.name, proc.returncode, out, time.monotonic() - start))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return runs


def records(output: str, tag: str) -> list[list]:
    """Lines ``TAG a b ... <json>`` a worker printed (behind hvdrun's ``[r]<stdout>:`` prefix):
    each as ``[a, b, ..., parsed json]``."""
    pattern = rf"(?m)^(?:\[[^\]]*\](?:<std\w+>)?:)?{tag} ((?:[^\s\[{{]\S* )*)([\[{{].*)$"
    return [[*m.group(1).split(), json.loads(m.group(2))] for m in re.finditer(pattern, output)]

def same_line(c: Cluster, script: str, *extra: str, np_per_host: int = 2, timeout: float = 180.0,
              hvdrun_args: tuple[str, ...] = ()) -> list[HostRun]:
    """``hvdrun -np N -H h1:k,... --port P --no-ssh python SCRIPT`` run on every host (same-line mode)."""
    spec = ",".join(f"{h.name}:{np_per_host}" for h in c.hosts)
    argv = [*HVDRUN, "-np", str(np_per_host * len(c.hosts)), "-H", spec, "--port", "29400", "--no-ssh",
            *hvdrun_args, sys.executable, str(SCRIPTS / script), *extra]
    return run_on_hosts(c.hosts, argv, timeout=timeout)

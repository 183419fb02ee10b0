"""Run the same hvdrun line on every test host, stream its output, time a fault's effects."""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.multihost.netns import Cluster, Host

__all__ = ["Job", "SCRIPTS", "start_job"]

SCRIPTS = Path(__file__).resolve().parent / "scripts"


@dataclass
class Job:
    """One hvdrun per host, with every line of output kept (with the second it arrived)."""

    procs: dict[str, subprocess.Popen]
    lines: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)
    _pumps: list[threading.Thread] = field(default_factory=list)

    def text(self, host: str) -> str:
        return "\n".join(line for _, line in self.lines[host])

    def wait_for(self, host: str, needle: str, timeout: float) -> bool:
        """Whether ``needle`` appeared in ``host``'s output within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(needle in line for _, line in self.lines[host]):
                return True
            if all(p.poll() is not None for p in self.procs.values()):
                return False
            time.sleep(0.05)
        return False

    def wait_exit(self, host: str, timeout: float) -> float | None:
        """Seconds until ``host``'s hvdrun ended (None: still running after ``timeout``)."""
        start = time.monotonic()
        try:
            self.procs[host].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        return time.monotonic() - start

    def first(self, host: str, needle: str, after: float = 0.0) -> float | None:
        """When (``time.monotonic()``) ``needle`` first appeared in ``host``'s output after ``after``."""
        for t, line in self.lines[host]:
            if t >= after and needle in line:
                return t
        return None

    def tail(self, n: int = 40) -> str:
        return "\n".join(f"--- {h} ---\n" + "\n".join(text for _, text in self.lines[h][-n:])
                         for h in self.lines)

    def exit_times(self, since: float, timeout: float) -> dict[str, float | None]:
        """Seconds from ``since`` until each host's hvdrun ended (None: still running at ``timeout``)."""
        ended: dict[str, float | None] = {name: None for name in self.procs}
        deadline = since + timeout
        while any(t is None for t in ended.values()) and time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if ended[name] is None and proc.poll() is not None:
                    ended[name] = time.monotonic() - since
            time.sleep(0.05)
        return ended


def start_job(c: Cluster, hosts: list[Host], argv: list[str], env: dict[str, str] | None = None) -> Job:
    """Start ``argv`` (an hvdrun line) on every host of ``hosts`` at once."""
    procs = {h.name: h.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for h in hosts}
    job = Job(procs, {h.name: [] for h in hosts})

    def pump(name: str, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            job.lines[name].append((time.monotonic(), line.rstrip("\n")))

    for name, proc in procs.items():
        thread = threading.Thread(target=pump, args=(name, proc), daemon=True)
        thread.start()
        job._pumps.append(thread)
    return job

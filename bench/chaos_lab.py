"""The chaos bench on the lab: two namespace hosts, one worker each, faults of three kinds.

Used by ``bench/elastic_chaos.py --lab RATE`` (never run alone). ``h1`` and ``h2`` (a
:func:`tests.multihost.netns.cluster`, each port shaped to ``RATE`` with ``tc``, see
:mod:`bench.lab.net`) each run the same hvdrun line, ``-np 2 -H h1:1,h2:1 --min-np 1 --max-np 2``
with the mode's ``--recovery``. ``h1`` is never hit (its worker is slot 0, whose steps give the
timeline); the faults hit ``h2``, in turn:

- ``worker``: SIGKILL of h2's worker process (its replacement sleeps ``--restart-delay`` first);
- ``cut``: h2's link taken down at the switch for ``--cut-seconds`` (no RST: a partition), then
  brought back;
- ``host``: SIGKILL of everything in h2's namespace, agent included (a machine that died).

Like a node manager (Kubernetes, Slurm's requeue), the bench starts h2's hvdrun line again
``--restart-delay`` s after it ended, once h2's link is up; h2 then comes back through hvdrun's
rendezvous. Everything else (the stop file, the figures) is as on one host.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.elastic_chaos import HVDRUN, WORKER, Kill, Mode, Run, env_for_workers, wait_first_step

if TYPE_CHECKING:
    from tests.multihost.netns import Cluster

__all__ = ["FAULTS", "lab_modes", "launch_lab"]

FAULTS = ("worker", "cut", "host")
_TICK = 0.05


def lab_modes(max_restarts: int) -> dict[str, Mode]:
    """The two recovery paths across hosts (one worker per host, so ``--min-np 1`` counts hosts)."""
    common = ["-H", "h1:1,h2:1", "--min-np", "1", "--max-np", "2", "--max-restarts", str(max_restarts),
              "--no-ssh", "--port", "29400", "--start-timeout", "120"]
    return {"inprocess": Mode("inprocess", [*common, "--recovery", "in-process"], 1),
            "restart": Mode("restart", [*common, "--recovery", "restart"], 1)}


class _Host2:
    """h2's hvdrun line: started, killed with its host, cut off, started again."""

    def __init__(self, c: Cluster, cmd: list[str], env: dict[str, str], run: Run, log) -> None:  # noqa: ANN001
        self.c, self.cmd, self.env, self.run, self.log = c, cmd, env, run, log
        self.proc: subprocess.Popen | None = None
        self.ended_at: float | None = None
        self.cut_until: float | None = None
        self.lines = 0
        self.starts = 0

    def start(self) -> None:
        self.proc = _popen(self.c.hosts[1], self.cmd, self.env, self.run, self.log, "h2")
        self.ended_at, self.starts = None, self.starts + 1

    def tick(self, now: float, delay: float, stopping: bool) -> None:
        """Heal a cut that is due; start the line again ``delay`` s after it ended."""
        if self.cut_until is not None and now >= self.cut_until:
            self.c.heal(self.c.hosts[1])
            self.cut_until = None
        if self.proc is None or self.proc.poll() is None or stopping:
            return
        self.ended_at = self.ended_at or now
        if self.cut_until is None and now >= self.ended_at + delay:
            self.run.lines.append(f"chaos-lab: h2's hvdrun ended ({self.proc.returncode}); starting it again")
            self.start()


def _popen(host, cmd: list[str], env: dict[str, str], run: Run, log, name: str) -> subprocess.Popen:  # noqa: ANN001
    proc = host.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            log.write(f"{name} {time.time():.3f} {line}")
            run.take(line.rstrip("\n"), host=name)

    threading.Thread(target=pump, daemon=True).start()
    return proc


def _fault(kind: str, run: Run, h2: _Host2, delay: float, cut_seconds: float) -> None:
    start = run.latest_start("h2")
    if start is None or h2.cut_until is not None:
        print(f"  {run.mode}: h2 is cut off or has no worker yet; no {kind} fault", flush=True)
        return
    t = time.time()
    if kind == "worker":
        (run.directory / f"delay.{start['slot']}").write_text(str(delay))
        try:
            os.kill(start["pid"], signal.SIGKILL)
        except ProcessLookupError:
            (run.directory / f"delay.{start['slot']}").unlink(missing_ok=True)
            print(f"  {run.mode}: h2's worker {start['pid']} already gone; no kill", flush=True)
            return
    elif kind == "host":
        h2.c.kill_host(h2.c.hosts[1])
    else:
        h2.c.cut(h2.c.hosts[1])
        h2.cut_until = time.time() + cut_seconds
    run.kills.append(Kill(start["slot"], start["pid"], t, kind))


def launch_lab(mode: Mode, args, directory: Path, kill_at: list[float], duration: float,  # noqa: ANN001
               delay: float, c: Cluster) -> Run:
    """As :func:`bench.elastic_chaos.launch`, on the lab: the fault at ``kill_at[i]`` is
    ``args.faults[i % len(args.faults)]``; returns h1's hvdrun status as the run's."""
    directory.mkdir(parents=True)
    run = Run(mode.name, directory)
    cmd = [*HVDRUN, "-np", "2", *mode.flags, sys.executable, str(WORKER), str(directory),
           str(mode.commit_every)]
    env = {**env_for_workers(), "HOROVOD_SECRET_KEY": secrets.token_hex(16)}
    log = (directory / "output.log").open("w")
    h1 = _popen(c.hosts[0], cmd, env, run, log, "h1")
    h2 = _Host2(c, cmd, env, run, log)
    h2.start()
    try:
        t0 = wait_first_step(run, h1, args.start_timeout)
        faults = [(t0 + offset, args.faults[i % len(args.faults)]) for i, offset in enumerate(kill_at)]
        while (now := time.time()) < t0 + duration:
            if faults and now >= faults[0][0]:
                _fault(faults.pop(0)[1], run, h2, delay, args.cut_seconds)
            h2.tick(now, delay, stopping=False)
            time.sleep(_TICK)
        while h2.cut_until is not None:  # never stop with the link down
            h2.tick(time.time(), delay, stopping=True)
            time.sleep(_TICK)
        (directory / "stop").touch()
        run.returncode = h1.wait(timeout=args.stop_timeout)
        if h2.proc is not None:
            h2.proc.wait(timeout=args.stop_timeout)
    except subprocess.TimeoutExpired:
        run.hung = True
    finally:
        for host in c.hosts:  # frees the port for the next run
            c.heal(host)
            c.kill_host(host)
        log.close()
    h2_rc = None if h2.proc is None else h2.proc.returncode
    run.lines.append(f"chaos-lab: h2's line started {h2.starts} time(s), the last ended {h2_rc}")
    if run.hung or run.returncode != 0:
        print(f"  {mode.name}: h1's hvdrun {'did not stop' if run.hung else f'exited {run.returncode}'}; "
              f"output in {directory / 'output.log'}\n{run.tail()}", flush=True)
    return run

"""Run hvdrun as a subprocess with a hard timeout; report the command and output tail on failure."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


@dataclass
class Result:
    cmd: list[str]
    returncode: int
    output: str
    ended_at: float
    """time.time() when hvdrun exited."""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.output.splitlines()[-lines:])

    def explain(self) -> str:
        return f"command: {' '.join(self.cmd)}\nrc={self.returncode}\n--- output tail ---\n{self.tail()}"


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without launcher variables, with PYTHONPATH at this checkout."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def hvdrun(args: list[str], *, timeout: float = 120.0, env: dict[str, str] | None = None) -> Result:
    """``hvdrun ARGS`` (the console script's code) with a hard timeout (a hang fails the test)."""
    cmd = [sys.executable, "-c", "import sys; from hvd_trainer.launch.cli import main; sys.exit(main())",
           *args]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env or clean_env(), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        raise AssertionError(f"hvdrun did not finish within {timeout}s\ncommand: {' '.join(cmd)}\n"
                             f"--- output tail ---\n{out[-4000:]}") from None
    return Result(cmd, proc.returncode, proc.stdout + proc.stderr, time.time())


def pids_from(output: str) -> list[int]:
    """PIDs printed by workers as ``PID <rank> <pid>`` lines (behind hvdrun's ``[0]<stdout>:`` prefix)."""
    return [int(m.group(1)) for m in re.finditer(r"(?m)^(?:\[\w+\](?:<std\w+>)?:)?PID \d+ (\d+)$", output)]


def last_line(output: str) -> str:
    """The last non-empty line of ``output``."""
    return [line for line in output.splitlines() if line.strip()][-1]


def fail_time(output: str) -> float:
    """The ``FAIL_AT <unix time>`` a worker printed just before failing."""
    match = re.search(r"FAIL_AT (\d+\.\d+)", output)
    assert match is not None, output[-3000:]
    return float(match.group(1))


def alive(pids: list[int], grace_seconds: float = 3.0) -> list[int]:
    """The pids still running (not zombies) after a short grace period."""
    deadline = time.monotonic() + grace_seconds
    while True:
        left = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
            except OSError:
                continue
            if state != "Z":
                left.append(pid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def run_two_ranks(script_args: list[str], *, timeout: float = 120.0,
                  **env: str) -> tuple[list[subprocess.Popen], str, str, float]:
    """Run ``python SCRIPTS/<script_args...>`` as ranks 0 and 1 of a world of 2 without a
    launcher (torchrun-style variables, a fresh port), wait for rank 1 then rank 0 and kill
    what is left. Returns the processes, rank 0's and rank 1's output, and when rank 0 ended."""
    from hvd_trainer.comm.world.world import free_port

    port = str(free_port())
    procs = []
    for rank in (0, 1):
        rank_env = clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env)
        cmd = [sys.executable, str(SCRIPTS / script_args[0]), *script_args[1:]]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=rank_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        out1, _ = procs[1].communicate(timeout=timeout)
        out0, _ = procs[0].communicate(timeout=timeout / 2)
        ended = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return procs, out0, out1, ended

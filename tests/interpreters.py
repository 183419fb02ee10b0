"""Fresh Python interpreters for tests that need one each (import order, logging set-up):
started at once, since each spends seconds importing, and waited for together."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence


def run_at_once(codes: Sequence[str], *, envs: Sequence[Mapping[str, str] | None] | None = None,
                flags: Sequence[str] = (), cwd: str | None = None,
                timeout_seconds: float = 180.0) -> list[subprocess.CompletedProcess]:
    """Run ``python FLAGS -c CODE`` for every code concurrently; results in the same order.

    ``envs[i]`` is the i-th interpreter's whole environment (``None``: this one's). Raises
    ``subprocess.TimeoutExpired`` when one is still running ``timeout_seconds`` after the start
    of the wait (all are killed then).
    """
    envs = list(envs) if envs is not None else [None] * len(codes)
    procs = [subprocess.Popen([sys.executable, *flags, "-c", code], env=env, cwd=cwd, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for code, env in zip(codes, envs, strict=True)]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout_seconds)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done

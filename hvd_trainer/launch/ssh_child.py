"""The remote end of hvdrun's ssh launch: ``python -m hvd_trainer.launch.ssh_child HVDRUN-ARGS``.

Started by the launching hvdrun on every other host (see :mod:`hvd_trainer.launch.ssh`). It

1. reads the first stdin line, a JSON object ``{"env": {...}}``, into its environment (so
   variables, a job secret among them, never appear on a command line);
2. watches the rest of stdin: when it ends (the launcher stopped the job, or died, or the ssh
   connection dropped), it sends itself SIGTERM, on which torchrun's agent stops its workers;
3. runs hvdrun with the given arguments (``--this-host H ...``: this host's agent only).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from hvd_trainer.launch.cli import main as hvdrun_main

__all__ = ["main"]


def _read_line(fd: int = 0) -> bytes:
    """One line from ``fd``, read unbuffered (the watcher thread owns the rest of the stream)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        data += chunk
    return data


def _stop_when_stdin_ends() -> None:
    # os.read, not sys.stdin: a daemon thread blocked in a buffered read aborts interpreter exit.
    while os.read(0, 65536):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> int:
    """Apply the environment line, start the stdin watcher, run hvdrun; returns its status."""
    line = _read_line()
    if not line:
        print("hvdrun: error: the launching hvdrun went away before this host started.", file=sys.stderr)
        return 1
    os.environ.update(json.loads(line)["env"])
    threading.Thread(target=_stop_when_stdin_ends, daemon=True).start()
    return hvdrun_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The other hosts' agents, each an ssh session: started, their output forwarded, stopped together.

Each session gets the carried environment as its first stdin line, then its stdin stays open:
closing it (``stop()``, or this process dying) makes the remote hvdrun stop its agent and workers
(see :mod:`hvd_trainer.launch.ssh_child`). Remote lines that a worker already prefixed with its
rank (``[3]<stdout>:...``) pass through unchanged; the agent's own lines get the host's name
(``[h2]:...``). Each line is written whole with one ``write`` so lines of different hosts and
ranks never interleave.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from hvd_trainer.launch.ssh import env_line

__all__ = ["RemoteAgents", "RemoteExit"]

_RANK_PREFIXED = re.compile(rb"^\[\d+\]")


@dataclass(frozen=True, slots=True)
class RemoteExit:
    """How one host's ssh session ended: exit status (ssh's 255: could not connect) and when."""

    host: str
    returncode: int
    seconds: float


def _pump(source: BinaryIO, fd: int, host: str) -> None:
    tag = f"[{host}]:".encode()
    for line in iter(source.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        os.write(fd, line if _RANK_PREFIXED.match(line) else tag + line)
    source.close()


class RemoteAgents:
    """ssh sessions to the other hosts, by host name.

    Args:
        commands: ``{host: ssh argv}`` (see :func:`hvd_trainer.launch.ssh.ssh_command`).
        env: variables sent to every session on its stdin.
        on_failure: called once, from a watcher thread, when a session ends with a non-zero
            status while the job is not being stopped (the first such exit is :attr:`failure`).
    """

    def __init__(self, commands: dict[str, list[str]], env: dict[str, str],
                 on_failure: Callable[[RemoteExit], None]) -> None:
        self._commands, self._env, self._on_failure = commands, env, on_failure
        self._procs: dict[str, subprocess.Popen] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._start = time.monotonic()
        self.exits: dict[str, RemoteExit] = {}
        self.failure: RemoteExit | None = None

    def start(self) -> None:
        """Start every session (its own process session: a Ctrl-C reaches hvdrun, not ssh)."""
        for host, cmd in self._commands.items():
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            self._procs[host] = proc
            assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
            try:
                proc.stdin.write(env_line(self._env))
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # ssh ended already; the watcher reports its status
            for source, fd in ((proc.stdout, 1), (proc.stderr, 2)):
                self._spawn(_pump, source, fd, host)
            self._spawn(self._watch, host, proc)

    def _spawn(self, target: Callable, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _watch(self, host: str, proc: subprocess.Popen) -> None:
        code = proc.wait()
        done = RemoteExit(host, code, time.monotonic() - self._start)
        with self._lock:
            self.exits[host] = done
            first = code != 0 and not self._stopping and self.failure is None
            if first:
                self.failure = done
        if first:
            self._on_failure(done)

    def wait(self) -> None:
        """Wait until every session has ended (raises KeyboardInterrupt on Ctrl-C, as usual)."""
        for proc in self._procs.values():
            while proc.poll() is None:
                time.sleep(0.1)

    def stop(self, grace_seconds: float = 15.0) -> None:
        """End every session: close its stdin (the remote agent stops its workers), then after
        ``grace_seconds`` SIGTERM and SIGKILL the ssh clients still running."""
        with self._lock:
            self._stopping = True
        for proc in self._procs.values():
            if proc.stdin is not None and not proc.stdin.closed:
                with contextlib.suppress(BrokenPipeError):
                    proc.stdin.close()
        deadline = time.monotonic() + grace_seconds
        for proc in self._procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for thread in self._threads:
            thread.join(timeout=5)

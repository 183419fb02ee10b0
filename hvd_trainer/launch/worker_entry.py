"""The per-worker step of hvdrun: Horovod's variables, rank-prefixed output, per-rank log files.

hvdrun's launcher (torchrun or mpirun) starts ``python worker_entry.py COMMAND ...`` for every
rank instead of ``COMMAND`` itself. This file imports only the standard library (it runs as a
script, not as ``hvd_trainer.launch.worker_entry``, so no torch import delays the start). It

1. exports what ``horovodrun`` gives every worker: ``HOROVOD_RANK``, ``HOROVOD_SIZE``,
   ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``, ``HOROVOD_CROSS_RANK``,
   ``HOROVOD_CROSS_SIZE``, ``HOROVOD_HOSTNAME``, derived from torchrun's ``RANK``,
   ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``
   or from Open MPI / PMI variables (cross rank = the host's index, cross size = the host count,
   as Horovod computes them when every host runs the same number of processes);
2. runs ``COMMAND`` as a child with its stdout/stderr on pipes and writes every line, whole, as
   ``[<rank>]<stdout>:<line>`` (``<stderr>`` for stderr; ``HVDRUN_PREFIX_TIMESTAMP=1`` puts a UTC
   time first), so two ranks' prints never merge into one line; Python children get
   ``PYTHONUNBUFFERED=1`` so their lines appear as they are printed. Progress bars (Keras'
   ``verbose=1``, tqdm: displays redrawn after ``\r``, Keras' with ``\b`` before it) are shown
   for rank 0 only, as Horovod advised (``verbose=1 if hvd.rank() == 0 else 0``): redrawn in
   place when hvdrun's output is a terminal (``HVDRUN_TERMINAL``), else one whole line at most every
   ``HVDRUN_PROGRESS_INTERVAL`` seconds (default 5) and the bar's last line; the other ranks'
   bars, final lines and Keras' ``Epoch 1/3`` line before each included, go only to their
   ``--output-filename`` logs (see :class:`LineSplitter`); on a terminal every line starts at
   column 0 and clears the rest of it, so another rank's line replaces a bar drawn there;
3. with ``HVDRUN_OUTPUT_DIR`` set (``--output-filename DIR``), also appends the raw lines to
   ``DIR/rank.<rank>/stdout`` and ``DIR/rank.<rank>/stderr`` (Horovod's layout; a restarted
   attempt appends after a ``=== attempt <k> ===`` line);
4. writes the child's pid to ``$HVDRUN_JOB_DIR/pid.<rank>``, so hvdrun names the same pid as
   the rank itself (``RankFailedError``, its prints) instead of this entry's;
5. starts the child in a process group of its own and forwards SIGTERM/SIGINT to that group,
   so the command (and what it started) gets each stop request exactly once: torchrun's agent
   signals the entry's whole group (``os.killpg``), and a child in that group got the signal
   twice, the second after a Lightning run had already restored the default handler, killing it
   before it printed its error. The child dies with the entry (``PR_SET_PDEATHSIG``: a
   SIGKILLed entry takes its child along), and the entry ends with the child's status (the same
   signal when the child was killed), so the launcher sees what the command did;
6. with in-process recovery (``HVDRUN_RECOVERY=in-process``, ``hvdrun --recovery in-process``):
   when the child is killed by a signal (SIGKILL, SIGSEGV, the OOM killer; not the launcher's
   SIGTERM/SIGINT), starts the command again at once, alone, up to ``HVDRUN_RESPAWNS`` times
   (``HVDRUN_RESPAWN_COUNT`` tells it which start it is). torchrun's agent never sees the loss,
   so it does not stop the survivors; the new process joins them at their next commit. The
   killed process's pid goes to ``$HVDRUN_JOB_DIR/lost.<rank>`` first: hvdrun's agent on this
   host tells the job's store, so ranks on other hosts know at once that it is gone. A child
   that *exits* (0, a user error, a peer's failure it could not recover from) ends the entry.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import BinaryIO

__all__ = ["horovod_env", "prefix", "LineSplitter", "main"]

TERMINAL_ENV = "HVDRUN_TERMINAL"
"""Which of hvdrun's own streams are a terminal (``stdout,stderr``), set by hvdrun for workers on
its own host only: there, rank 0's bars are redrawn in place. Not a test of this process's
stream, which Open MPI makes a pseudo-terminal whatever hvdrun's output is."""
PROGRESS_INTERVAL_S = 5.0
"""Default seconds between two progress lines of rank 0 when the output is not a terminal."""

_RANK_SOURCES = (
    # rank, size, local rank, local size, cross rank, cross size (None: derived)
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", None, None),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None, None),
)


def horovod_env(env: Mapping[str, str], hostname: str | None = None) -> dict[str, str]:
    """``HOROVOD_*`` variables for this worker from the launcher's variables in ``env``.

    Returns an empty dict when no launcher variables are there. Missing local values mean one
    process per host; cross rank/size default to ``rank // local_size`` and
    ``size // local_size``.
    """
    for names in _RANK_SOURCES:
        if names[0] in env and names[1] in env:
            break
    else:
        return {}
    rank, size = int(env[names[0]]), int(env[names[1]])
    local_rank = int(env.get(names[2], "0"))
    local_size = max(1, int(env.get(names[3], "1")))
    cross_rank = int(env[names[4]]) if names[4] and names[4] in env else rank // local_size
    cross_size = int(env[names[5]]) if names[5] and names[5] in env else max(1, size // local_size)
    values = {"RANK": rank, "SIZE": size, "LOCAL_RANK": local_rank, "LOCAL_SIZE": local_size,
              "CROSS_RANK": cross_rank, "CROSS_SIZE": cross_size}
    out = {f"HOROVOD_{key}": str(value) for key, value in values.items()}
    out["HOROVOD_HOSTNAME"] = hostname or socket.gethostname()
    return out


def prefix(rank: str, stream: str, timestamp: bool) -> bytes:
    """``[1]<stdout>:`` (with a leading ``Tue Dec  1 10:00:00 2026 `` UTC time if ``timestamp``)."""
    when = time.asctime(time.gmtime()) + " " if timestamp else ""
    return f"{when}[{rank}]<{stream}>:".encode()


_ENDS = re.compile(rb"[\r\n]")
_BAR_HEADER = re.compile(rb"Epoch \d+/\d+\Z")
"""Keras' line before each epoch's bar (``verbose=1``): hidden with the bar on ranks other than 0."""


class LineSplitter:
    """Splits a child's output into whole lines and progress displays.

    A display is text that the program redraws in place: it ends at a ``\r`` (tqdm writes
    ``\r`` + bar; Keras ``\b`` * width + ``\r`` + bar; the ``\b`` are dropped). :meth:`feed`
    takes raw bytes as they arrive and returns ``(kind, text)`` events, ``text`` without its
    ending: ``("display", text)`` for each display, and ``("line", text)`` or ``("bar_end",
    text)`` at each ``\n``, the latter when the line ends a progress bar (a ``\r`` was seen on it
    before its last text, or at least two displays were). ``"abc\r\n"`` is a plain line.
    """

    def __init__(self) -> None:
        self._text = bytearray()
        self._display: bytes | None = None
        self._displays = 0
        self._saw_cr = False

    def feed(self, data: bytes) -> list[tuple[str, bytes]]:
        events: list[tuple[str, bytes]] = []
        start = 0
        for match in _ENDS.finditer(data):
            i, byte = match.start(), data[match.start()]
            self._text += data[start:i]
            start = i + 1
            text = self._text.replace(b"\b", b"").rstrip()
            self._text.clear()
            if byte == 13:
                if text:
                    self._display, self._displays = text, self._displays + 1
                    events.append(("display", text))
                self._saw_cr = True
            elif text:
                events.append(("bar_end" if self._saw_cr else "line", text))
                self._reset()
            else:
                display = self._display or b""
                events.append(("bar_end" if self._displays >= 2 else "line", display))
                self._reset()
        self._text += data[start:]
        return events

    def close(self) -> list[tuple[str, bytes]]:
        """Events for text left without a ``\n`` at the end of the stream."""
        return self.feed(b"\n") if self._text.replace(b"\b", b"").strip() or self._display else []

    def _reset(self) -> None:
        self._display, self._displays, self._saw_cr = None, 0, False


class _Pump(threading.Thread):
    """Copies one pipe of the child to our stream (prefixed lines, see the module docstring) and
    its raw bytes to a log file."""

    def __init__(self, source: BinaryIO, sink: BinaryIO, rank: str, stream: str,
                 log: BinaryIO | None, timestamp: bool, progress_interval: float, live: bool) -> None:
        super().__init__(daemon=True, name=f"hvdrun-{stream}")
        self.source, self.sink, self.rank, self.stream = source, sink, rank, stream
        self.log, self.timestamp = log, timestamp
        self.show_progress = rank == "0"
        self.live = live
        self.interval = progress_interval
        self._last_shown = float("-inf")
        self._held: bytes | None = None  # another rank's Keras "Epoch 1/3" line, until we see a bar

    def run(self) -> None:
        splitter = LineSplitter()
        fd = self.source.fileno()
        while chunk := os.read(fd, 65536):
            if self.log is not None:
                self.log.write(chunk)
                self.log.flush()
            self._emit(splitter.feed(chunk))
        self._emit(splitter.close())
        self.flush_held()

    def _emit(self, events: list[tuple[str, bytes]]) -> None:
        out = bytearray()
        for kind, text in events:
            head = prefix(self.rank, self.stream, self.timestamp)
            if kind == "display":
                out += self._display(head, text)
            else:
                out += self._whole(kind, head, text)
        if out:
            self.sink.write(bytes(out))
            self.sink.flush()

    def _display(self, head: bytes, text: bytes) -> bytes:
        if not self.show_progress:
            self._held = None  # the header belonged to a hidden bar
            return b""
        if self.live:
            return b"\r" + head + text + b"\x1b[K"  # erase what a longer display left
        if time.monotonic() - self._last_shown >= self.interval:
            self._last_shown = time.monotonic()
            return head + text + b"\n"
        return b""

    def _whole(self, kind: str, head: bytes, text: bytes) -> bytes:
        if kind == "bar_end" and not self.show_progress:
            self._held = None
            return b""
        out = b""
        if self._held is not None:
            out, self._held = self._line(head, self._held), None
        if kind == "line" and not self.show_progress and _BAR_HEADER.match(text):
            self._held = text  # shown unless a (hidden) bar follows it
            return out
        if kind == "bar_end":
            self._last_shown = float("-inf")  # the next bar's first display is shown
        return out + self._line(head, text)

    def _line(self, head: bytes, text: bytes) -> bytes:
        """One whole line; on a terminal it starts at column 0 and clears the rest of the line,
        so it replaces a bar another rank has drawn there (the bar is redrawn below it)."""
        if self.live:
            return b"\r" + head + text + b"\x1b[K\n"
        return head + text + b"\n"

    def flush_held(self) -> None:
        """Write a held header that no bar followed (at the end of the stream)."""
        if self._held is not None:
            self.sink.write(self._line(prefix(self.rank, self.stream, self.timestamp), self._held))
            self.sink.flush()
            self._held = None


def _progress_interval(env: Mapping[str, str]) -> float:
    """``HVDRUN_PROGRESS_INTERVAL`` (seconds, >= 0), else :data:`PROGRESS_INTERVAL_S`."""
    try:
        return max(0.0, float(env.get("HVDRUN_PROGRESS_INTERVAL", PROGRESS_INTERVAL_S)))
    except ValueError:
        return PROGRESS_INTERVAL_S


def _child_setup() -> None:
    """In the child, before exec: a process group of its own (the entry forwards stop signals
    to it, see the module docstring) and SIGKILL when the entry dies (Linux only)."""
    os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _open_logs(directory: str, rank: str) -> tuple[BinaryIO, BinaryIO]:
    folder = os.path.join(directory, f"rank.{rank}")
    os.makedirs(folder, exist_ok=True)
    logs = tuple(open(os.path.join(folder, name), "ab") for name in ("stdout", "stderr"))  # noqa: SIM115
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt != "0":
        for log in logs:
            log.write(f"=== attempt {attempt} ===\n".encode())
    return logs  # type: ignore[return-value]


def _write_job_file(job_dir: str | None, name: str, text: str) -> None:
    """``<job_dir>/<name>`` replaced atomically (a reader never sees half of it); nothing
    without a job directory."""
    if not job_dir:
        return
    path = os.path.join(job_dir, name)
    with contextlib.suppress(OSError):
        with open(path + ".tmp", "w") as fh:
            fh.write(text)
        os.replace(path + ".tmp", path)


def _write_pid(job_dir: str | None, rank: str, pid: int) -> None:
    """``<job_dir>/pid.<rank>``: the command's pid, for hvdrun's lines about this rank (torchrun
    knows only this entry's pid)."""
    _write_job_file(job_dir, f"pid.{rank}", str(pid))


def _write_count(job_dir: str | None, rank: str, respawns: int) -> None:
    """``<job_dir>/respawns.<rank>``: how often this rank was started again alone (hvdrun's
    closing line counts them)."""
    _write_job_file(job_dir, f"respawns.{rank}", str(respawns))


def _write_lost(job_dir: str | None, rank: str, pid: int) -> None:
    """``<job_dir>/lost.<rank>``: the pid of this rank's command that was killed and is being
    started again; hvdrun's agent writes it into the job's store (``AgentWatch.report_lost``)."""
    _write_job_file(job_dir, f"lost.{rank}", str(pid))


def _exit_like(returncode: int) -> None:
    if returncode < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL/SIGSTOP cannot be handled anyway
            signal.signal(-returncode, signal.SIG_DFL)
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), -returncode)
        time.sleep(5.0)  # the signal ends us; this only covers a signal that does not kill
        os._exit(128 - returncode)
    sys.exit(returncode)


def _respawn_budget(env: Mapping[str, str]) -> int:
    """How often a killed child is started again alone (0 without in-process recovery)."""
    if env.get("HVDRUN_RECOVERY") != "in-process":
        return 0
    try:
        return max(0, int(env.get("HVDRUN_RESPAWNS", "0")))
    except ValueError:
        return 0


def _killed(returncode: int, stopping: bool) -> bool:
    """The child died of a signal that was not the launcher's stop request."""
    return returncode < 0 and not stopping and -returncode not in (signal.SIGTERM, signal.SIGINT)


def _started_pumps(child: subprocess.Popen[bytes], rank: str, logs: tuple[BinaryIO | None, BinaryIO | None],
                   timestamp: bool, interval: float, live: list[str]) -> list[_Pump]:
    """The child's stdout and stderr copied, line by line, by two started threads."""
    pumps = [_Pump(child.stdout, sys.stdout.buffer, rank, "stdout", logs[0], timestamp,  # type: ignore[arg-type]
                   interval, "stdout" in live),
             _Pump(child.stderr, sys.stderr.buffer, rank, "stderr", logs[1], timestamp,  # type: ignore[arg-type]
                   interval, "stderr" in live)]
    for pump in pumps:
        pump.start()
    return pumps


def main(argv: list[str]) -> None:
    """Run ``argv`` (the user's command) as described in the module docstring; never returns."""
    if not argv:
        sys.exit("worker_entry.py: no command given")
    env = dict(os.environ)
    env.update(horovod_env(env))
    env.setdefault("PYTHONUNBUFFERED", "1")
    rank = env.get("HOROVOD_RANK", "?")
    timestamp = env.get("HVDRUN_PREFIX_TIMESTAMP") == "1"
    interval = _progress_interval(env)
    live = env.get(TERMINAL_ENV, "").split(",")
    logs = _open_logs(env["HVDRUN_OUTPUT_DIR"], rank) if env.get("HVDRUN_OUTPUT_DIR") else (None, None)
    budget, respawns = _respawn_budget(env), 0
    stopping: list[bool] = []
    current: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(True)
        if current and current[-1].returncode is None:  # not reaped: its pid is still its own
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(current[-1].pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while True:
        env["HVDRUN_RESPAWN_COUNT"] = str(respawns)
        try:
            child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     preexec_fn=_child_setup)  # noqa: PLW1509
        except OSError as exc:
            sys.exit(f"[{rank}]<stderr>:hvdrun: cannot start {argv[0]!r}: {exc.strerror}")
        current.append(child)
        _write_pid(env.get("HVDRUN_JOB_DIR"), rank, child.pid)
        pumps = _started_pumps(child, rank, logs, timestamp, interval, live)
        returncode = child.wait()
        again = _killed(returncode, bool(stopping)) and respawns < budget
        if again:  # first, so the other hosts' membership round need not wait for it
            _write_lost(env.get("HVDRUN_JOB_DIR"), rank, child.pid)
        for pump in pumps:
            pump.join(timeout=5.0)  # a grandchild may keep a pipe open; do not wait for it forever
        if not again:
            _exit_like(returncode)
        respawns += 1
        _write_count(env.get("HVDRUN_JOB_DIR"), rank, respawns)
        name = signal.Signals(-returncode).name
        sys.stderr.buffer.write(
            prefix(rank, "stderr", timestamp) + f"hvdrun: rank {rank} (pid {child.pid}) was killed by "
            f"{name}; starting it again alone ({respawns} of {budget}); the other ranks go on and "
            "let it in at their next commit\n".encode())
        sys.stderr.flush()


if __name__ == "__main__":
    main(sys.argv[1:])

"""Progress bars under hvdrun: the worker entry's line splitting, and real Keras and tqdm bars run
through ``worker_entry.py`` (as hvdrun runs every rank) with rank 0's and rank 1's variables.

Keras' ``verbose=1`` redraws with ``\\b`` * width + ``\\r`` even on a pipe; whole-line forwarding
once joined an epoch's redraws into one line of tens of thousands of characters.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_trainer.launch.commands import WORKER_ENTRY
from hvd_trainer.launch.worker_entry import LineSplitter

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Keras colours its bar, on a pipe too


def _split(*chunks: bytes) -> list[tuple[str, bytes]]:
    splitter = LineSplitter()
    events = [e for chunk in chunks for e in splitter.feed(chunk)]
    return events + splitter.close()


KERAS_LIKE = b"\r1/3 [==>..]\b\b\b\b\b\b\b\b\b\b\b\r2/3 [====>]\b\b\b\b\b\b\b\b\b\b\b\r3/3 [=====] loss 0.1\n"


def test_splitter_keras_and_tqdm_bars() -> None:
    expected = [("display", b"1/3 [==>..]"), ("display", b"2/3 [====>]"),
                ("bar_end", b"3/3 [=====] loss 0.1")]
    assert _split(KERAS_LIKE) == expected
    assert _split(*[KERAS_LIKE[i:i + 1] for i in range(len(KERAS_LIKE))]) == expected  # any chunking
    tqdm_like = b"\r  0%|   | 0/2\r 50%|#  | 1/2   \r100%|###| 2/2\n"
    assert _split(tqdm_like) == [("display", b"0%|   | 0/2".rjust(13)), ("display", b" 50%|#  | 1/2"),
                                 ("bar_end", b"100%|###| 2/2")]
    # tqdm's close() may redraw and end with "\r\n"-less "\n" after a last display: a bar too
    assert _split(b"\ra\rb\r\n")[-1] == ("bar_end", b"b")


def test_splitter_plain_lines_stay_lines() -> None:
    assert _split(b"one\ntwo\r\nthree") == [("line", b"one"), ("display", b"two"), ("line", b"two"),
                                             ("line", b"three")]
    assert _split(b"\n") == [("line", b"")]  # an empty print stays an empty line
    assert _split(b"") == []


KERAS_BAR = """
import sys
from keras.utils import Progbar
print("before", flush=True)
for epoch in range(2):
    print(f"Epoch {epoch + 1}/2", flush=True)  # what Keras' fit prints before each bar
    bar = Progbar(300, interval=0)
    for i in range(300):
        bar.update(i + 1, values=[("loss", 1.0 / (i + 1))])
print("Epoch 7/7", flush=True)  # not followed by a bar: an ordinary line
print("after", flush=True)
"""

TQDM_BAR = """
from tqdm import tqdm
for _ in tqdm(range(300), mininterval=0, miniters=1):
    pass
print("done")
"""


def _entry(code: str, rank: int, tmp_path: Path, **env: str) -> str:
    run_env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "KERAS_BACKEND": "torch", "HVDRUN_OUTPUT_DIR": str(tmp_path),
               "PYTHONPATH": str(ROOT), **env}
    proc = subprocess.run([sys.executable, WORKER_ENTRY, sys.executable, "-c", code], env=run_env,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    return (proc.stdout + proc.stderr).decode()


def test_keras_bar_reads_like_one_process(tmp_path: Path) -> None:
    out0 = ANSI.sub("", _entry(KERAS_BAR, 0, tmp_path))
    lines = out0.splitlines()
    assert max(len(line) for line in lines) < 400, max(lines, key=len)[:300]
    assert "\r" not in out0 and "\b" not in out0  # not a terminal: whole lines only
    finals = [line for line in lines if line.startswith("[0]<stdout>:300/300 ")]
    assert len(finals) == 2, lines  # each bar's last line
    # 598 redraws, throttled to one line per 5 s (the first of each bar at once)
    assert 7 <= len(lines) <= 13, lines
    assert lines[0] == "[0]<stdout>:before" and lines[-1] == "[0]<stdout>:after"
    assert lines[1] == "[0]<stdout>:Epoch 1/2" and "[0]<stdout>:Epoch 2/2" in lines
    # rank 1: its bars (and Keras' epoch line before each) go only to its log file; its prints
    # are shown
    out1 = _entry(KERAS_BAR, 1, tmp_path)
    assert out1.splitlines() == ["[1]<stdout>:before", "[1]<stdout>:Epoch 7/7", "[1]<stdout>:after"]
    log = (tmp_path / "rank.1" / "stdout").read_bytes()
    assert log.count(b"\r") >= 598 and b"300/300" in log


def test_tqdm_bar_on_stderr(tmp_path: Path) -> None:
    lines = _entry(TQDM_BAR, 0, tmp_path).splitlines()
    bar = [line for line in lines if line.startswith("[0]<stderr>:")]
    assert 1 <= len(bar) <= 4 and "300/300" in bar[-1], lines
    assert "[0]<stdout>:done" in lines
    assert _entry(TQDM_BAR, 1, tmp_path).splitlines() == ["[1]<stdout>:done"]
    # every redraw shown when the interval is 0
    every = _entry(TQDM_BAR, 0, tmp_path, HVDRUN_PROGRESS_INTERVAL="0").splitlines()
    assert len(every) > 250


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_a_terminal_of_the_workers_own_is_not_hvdruns(tmp_path: Path) -> None:
    """Open MPI gives each process a pseudo-terminal whatever hvdrun's output is: without
    HVDRUN_TERMINAL the lines stay whole and free of control characters."""
    controller, terminal = os.openpty()
    env = {k: v for k, v in os.environ.items() if k != "HVDRUN_TERMINAL"}
    env.update({"RANK": "0", "WORLD_SIZE": "2", "PYTHONPATH": str(ROOT)})
    proc = subprocess.Popen([sys.executable, WORKER_ENTRY, sys.executable, "-c", TQDM_BAR], env=env,
                            stdout=terminal, stderr=terminal)
    os.close(terminal)
    text = _read_all(controller)
    assert proc.wait(timeout=60) == 0
    assert "\x1b[K" not in text and "[0]<stdout>:done\r\n" in text
    assert text.count("[0]<stderr>:") <= 4  # throttled whole lines, not every redraw


def _read_all(controller: int) -> str:
    data = bytearray()
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the terminal's last writer is gone
            break
        if not chunk:
            break
        data += chunk
    os.close(controller)
    return data.decode(errors="replace")


def test_hvdrun_says_which_of_its_streams_are_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from hvd_trainer.launch.commands import worker_env
    from hvd_trainer.launch.options import parse_options

    class Tty:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Tty())
    opts, _ = parse_options(["-np", "2", "python", "train.py"])
    assert opts is not None and worker_env(opts)["HVDRUN_TERMINAL"] == "stdout"
    for flags in (["--mpi"], ["-H", "h1:1,h2:1"]):  # another reader joins the lines there
        opts, _ = parse_options(["-np", "2", *flags, "python", "train.py"])
        assert opts is not None and "HVDRUN_TERMINAL" not in worker_env(opts)


def test_terminal_gets_rank0_bar_redrawn_in_place(tmp_path: Path) -> None:
    controller, terminal = os.openpty()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "PYTHONPATH": str(ROOT),
           "HVDRUN_TERMINAL": "stdout,stderr"}  # hvdrun's own output is a terminal
    proc = subprocess.Popen([sys.executable, WORKER_ENTRY, sys.executable, "-c", TQDM_BAR], env=env,
                            stdout=terminal, stderr=terminal)
    os.close(terminal)
    text = _read_all(controller)
    assert proc.wait(timeout=60) == 0
    assert text.count("\r[0]<stderr>:") > 100  # each redraw forwarded, in place
    # a whole line starts at column 0 and clears the rest: it replaces any bar drawn there
    assert "\r[0]<stdout>:done\x1b[K\r\n" in text  # (the terminal turns \n into \r\n)

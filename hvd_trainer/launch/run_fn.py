"""``hvd_trainer.run(fn, args, kwargs, np=N)``: Horovod's ``horovod.run`` on this machine.

Runs ``fn(*args, **kwargs)`` on ``np`` local processes and returns the ``np`` results in rank
order. ``fn`` usually calls ``hvd.init()`` first, as under ``horovod.run``. Each process is a
fresh interpreter started through hvdrun's worker entry (so it has torchrun-style ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and
Horovod's ``HOROVOD_*`` variables, and its output lines carry a ``[rank]<stdout>:`` prefix).
``fn``, its arguments and its result travel with ``cloudpickle`` (functions defined in
``__main__`` or interactively work; the calling script is not imported again).

The calling process hosts the job's ``TCPStore`` (bound to a port the OS picks, held until the
ranks end) and the ranks connect to it as torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``),
as under hvdrun: a port chosen first and bound only later by rank 0 could be taken meanwhile by
another program on a busy machine (``EADDRINUSE``).

Differences from Horovod (each raises with a HINT instead of doing something else): several
hosts, elastic arguments and ``use_mpi=True`` are for the ``hvdrun`` command line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hvd_trainer.launch.commands import HOROVOD_SHIM_DIR, WORKER_ENTRY

__all__ = ["run", "RunError"]

_PEER_ERRORS = ("RankFailedError", "StallError", "HorovodInternalError")
_WORKER_CODE = "from hvd_trainer.launch.run_fn import _worker_main; _worker_main()"
_RUN_DIR_ENV = "HVD_TRAINER_RUN_DIR"


class RunError(RuntimeError):
    """A rank of :func:`run` raised or died; ``rank`` names it, the message holds its traceback."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def _reject_unsupported(hosts: str | None, hostfile: str | None, elastic: dict[str, Any],
                        use_mpi: bool | None) -> None:
    if hosts and any(h.strip().split(":")[0] not in ("localhost", "127.0.0.1") for h in hosts.split(",")):
        raise ValueError(f"run(hosts={hosts!r}): run() starts processes on this machine only. "
                         "HINT: for several hosts use the hvdrun command on every host.")
    if hostfile is not None:
        raise ValueError("run(hostfile=...): run() starts processes on this machine only. "
                         "HINT: use hvdrun --hostfile FILE python train.py.")
    given = [k for k, v in elastic.items() if v is not None]
    if given:
        raise ValueError(f"run({', '.join(given)}=...): elastic runs restart whole processes here. "
                         "HINT: hvdrun --min-np/--max-np/--max-restarts with @hvd.elastic.run.")
    if use_mpi:
        raise ValueError("run(use_mpi=True) is not supported. HINT: hvdrun --mpi -np N python train.py.")


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    np: int = 1,
    min_np: int | None = None,
    max_np: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    executable: str | None = None,
    *,
    timeout_seconds: float | None = None,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``np`` local processes; return their results by rank.

    Horovod's parameters, in Horovod's order. Honoured: ``np``, ``hosts`` naming only this
    machine, ``start_timeout`` (seconds; exported as ``HOROVOD_START_TIMEOUT``),
    ``output_filename`` (``DIR/rank.<N>/{stdout,stderr}``), ``network_interface``,
    ``executable`` (the Python to run the workers with). Accepted without effect: ``slots``,
    ``ssh_port``, ``ssh_identity_file``, ``disable_cache``, ``verbose``, ``use_gloo``,
    ``mpi_args``. ``timeout_seconds`` (ours): stop every rank and raise ``TimeoutError``.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        ValueError: ``np < 1``, other hosts, a hostfile, elastic arguments or ``use_mpi=True``.
        RunError: a rank raised (the message names the rank and carries its traceback) or
            died without a result; the other ranks are stopped.
        TimeoutError: ``timeout_seconds`` passed.
    """
    import cloudpickle

    if np < 1:
        raise ValueError(f"run(np={np}): need at least one process. HINT: run(fn, np=2).")
    _reject_unsupported(hosts, hostfile, {"min_np": min_np, "max_np": max_np, "reset_limit": reset_limit},
                        use_mpi)
    with tempfile.TemporaryDirectory(prefix="hvd_trainer_run-") as tmp:
        run_dir = Path(tmp)
        (run_dir / "fn.pkl").write_bytes(cloudpickle.dumps((func, tuple(args), dict(kwargs or {}))))
        # Bound now and held until the ranks end: no other program can take the port meanwhile.
        store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=300), wait_for_workers=False)
        env = _base_env(run_dir, np, store.port, output_filename, network_interface, start_timeout)
        python = executable or sys.executable
        procs = [subprocess.Popen([python, WORKER_ENTRY, python, "-c", _WORKER_CODE],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
                 for r in range(np)]
        codes = _wait(procs, timeout_seconds)
        return _collect(run_dir, codes)


def _base_env(run_dir: Path, np: int, store_port: int, output_filename: str | None,
              network_interface: str | None, start_timeout: float | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"WORLD_SIZE": str(np), "LOCAL_WORLD_SIZE": str(np), "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port),
                # rank 0 connects to the caller's store like every rank (torch's env:// rendezvous)
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
                _RUN_DIR_ENV: str(run_dir)})
    if output_filename is not None:
        env["HVDRUN_OUTPUT_DIR"] = os.path.abspath(output_filename)
    if network_interface is not None:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = network_interface
    if start_timeout is not None:
        env["HOROVOD_START_TIMEOUT"] = f"{start_timeout:g}"
    if getattr(sys.modules.get("horovod"), "__hvd_trainer_alias__", False):
        # The caller's ``horovod`` is hvd_trainer's alias (a Horovod script calling horovod.run):
        # the workers get it too, for a function that imports horovod.torch inside.
        paths = [HOROVOD_SHIM_DIR, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _stop(procs: list[subprocess.Popen], grace_seconds: float = 5.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_seconds
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait(procs: list[subprocess.Popen], timeout_seconds: float | None) -> list[int]:
    """Wait for every rank; after the first failure give the others 2 s, then stop them."""
    deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > 2.0:
                break
            if deadline is not None and now > deadline:
                _stop(procs)
                raise TimeoutError(f"hvd_trainer.run: the ranks did not finish within {timeout_seconds:g} s; "
                                   "they were stopped.")
            time.sleep(0.05)
    finally:
        _stop(procs)
    return [p.returncode for p in procs]


def _collect(run_dir: Path, codes: list[int]) -> list[Any]:
    import cloudpickle

    results: dict[int, tuple[Any, ...]] = {}
    for rank in range(len(codes)):
        path = run_dir / f"result.{rank}.pkl"
        if path.exists():
            results[rank] = cloudpickle.loads(path.read_bytes())
    errors = [(r, res) for r, res in sorted(results.items()) if res[0] == "error"]
    if errors:
        own = [e for e in errors if e[1][1] not in _PEER_ERRORS]
        rank, (_, name, message, trace) = (own or errors)[0]
        raise RunError(f"hvd_trainer.run: rank {rank} raised {name}: {message}\n"
                       f"--- traceback of rank {rank} ---\n{trace}", rank)
    missing = [r for r in range(len(codes)) if r not in results]
    if missing:
        rank = missing[0]
        raise RunError(f"hvd_trainer.run: rank {rank} ended with status {codes[rank]} without a result "
                       "(killed, or it called sys.exit/os._exit). HINT: its output above says why.", rank)
    return [results[r][1] for r in range(len(codes))]


def _worker_main() -> None:
    """In each process: run the pickled function, store ``("ok", value)`` or the error."""
    import cloudpickle

    run_dir = Path(os.environ[_RUN_DIR_ENV])
    rank = int(os.environ["RANK"])
    out = run_dir / f"result.{rank}.pkl"
    try:
        func, args, kwargs = cloudpickle.loads((run_dir / "fn.pkl").read_bytes())
        record: tuple[Any, ...] = ("ok", func(*args, **kwargs))
        code = 0
    except Exception as exc:  # noqa: BLE001 - reported to the caller with the rank
        record = ("error", type(exc).__name__, str(exc), traceback.format_exc())
        code = 1
    try:
        payload = cloudpickle.dumps(record)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result
        payload = cloudpickle.dumps(("error", "TypeError", f"the result of rank {rank} cannot be "
                                     f"pickled: {exc}", traceback.format_exc()))
        code = 1
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(payload)
    tmp.replace(out)
    sys.stdout.flush()
    sys.exit(code)

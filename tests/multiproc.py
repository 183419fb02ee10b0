"""Run a function on N local processes over gloo, with a hard timeout.

Each worker gets torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT),
calls ``hvd_trainer.init()``, runs ``fn(*args)`` and sends back its return value or traceback.
A worker that hangs or dies fails the test with the rank named instead of stalling CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from hvd_trainer.comm.world.world import free_port


def _worker(rank: int, size: int, port: int, fn: Callable, args: tuple, env: dict, q) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(1)
        import hvd_trainer

        hvd_trainer.init(timeout_seconds=float(env.get("HVD_TEST_PG_TIMEOUT", 60)))
        result = fn(*args)
        q.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import hvd_trainer

            hvd_trainer.shutdown()
        except Exception:  # noqa: BLE001
            pass


def _drain(q, results: dict[int, tuple[str, Any]]) -> None:
    while not q.empty():
        rank, status, value = q.get()
        results[rank] = (status, value)


def _collect(q, procs: list, world_size: int, timeout_seconds: float) -> dict[int, tuple[str, Any]]:
    """Results by rank; raises AssertionError naming ranks that hang or die without a result."""
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_seconds
    while len(results) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(results))
            raise AssertionError(f"ranks {missing} did not finish within {timeout_seconds}s")
        try:
            rank, status, value = q.get(timeout=min(remaining, 1.0))
            results[rank] = (status, value)
            continue
        except queue.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
        if dead:
            time.sleep(0.5)
            _drain(q, results)
            codes = {r: procs[r].exitcode for r in dead if r not in results}
            if codes:
                raise AssertionError(f"ranks died without a result: exit codes {codes}")
    return results


def run_workers(
    fn: Callable,
    world_size: int = 2,
    *,
    args: tuple = (),
    env: dict[str, str] | None = None,
    timeout_seconds: float = 90.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` processes; return the results in rank order.

    Raises:
        AssertionError: a worker raised (its traceback is included), died, or did not finish
            within ``timeout_seconds`` (the missing ranks are named).
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, env or {}, q))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        results = _collect(q, procs, world_size, timeout_seconds)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise AssertionError(f"worker(s) failed:\n{text}")
    return [results[r][1] for r in range(world_size)]

"""Run a function on N local ranks over gloo, with a hard timeout, on reused rank processes.

``run_workers(fn, N)`` sends ``fn`` (by name: a module-level function of an importable module)
to N rank processes. Each run gets torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, a fresh MASTER_PORT), calls ``hvd_trainer.init()`` (a new process group), runs
``fn(*args)``, sends back its return value or traceback, and calls ``hvd_trainer.shutdown()``.

The rank processes are kept between runs, one pool per ``(world size, env)``: they are spawned
once, torch and hvd_trainer (and whatever the test module imports: Lightning, Keras) are
imported once, and ``env`` is in place before those imports, as in a fresh process. Before each
run a worker clears Keras's session (its layer-name counters); after it, it puts back
``os.environ`` and its working directory. A run that fails in any way
(a rank raised, died or hung) discards its pool, so the next run starts from fresh processes and
a broken process group never leaks into another test. A worker that hangs or dies fails the test
with the rank named instead of stalling CI.

``fresh_processes=True`` spawns processes for that run alone and ends them after it, for a test
that must own its processes (one that changes process-wide state the next test would inherit).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import itertools
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hvd_trainer.comm.world.world import free_port

MAX_IDLE_POOLS = 6
"""Pools kept alive at once; the least recently used one is stopped beyond that."""

_STACKS_BEFORE_SECONDS = 5.0
"""A hung rank dumps its threads' stacks and exits this long before the run's timeout."""

def _serve(rank: int, size: int, env: dict[str, str], tasks, results) -> None:
    """A rank process: import once, then run tasks until ``None`` arrives."""
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(size),
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": "1",
        }
    )
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    import hvd_trainer

    while True:
        task = tasks.get()
        if task is None:
            return
        task_id, port, fn, args, deadline, stacks_path = task
        # A rank still running shortly before the parent gives up (``deadline``: the parent's,
        # wall-clock) writes every thread's stack to ``stacks_path`` and exits: the parent puts
        # them in the failure, which then says where it hung.
        stacks_in = deadline - _STACKS_BEFORE_SECONDS - time.time()
        with open(stacks_path.format(rank=rank), "w") as stacks:
            faulthandler.dump_traceback_later(max(1.0, stacks_in), exit=True, file=stacks)
            try:
                results.put((task_id, rank, *_run_one(port, fn, args, env, hvd_trainer)))
            finally:
                faulthandler.cancel_dump_traceback_later()


def _run_one(port: int, fn: Callable, args: tuple, env: dict[str, str], hvd_trainer) -> tuple[str, Any]:
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ["MASTER_PORT"] = str(port)
    if "keras" in sys.modules:  # layer names (dense_3, ...) count per process: start each run at 0
        sys.modules["keras"].backend.clear_session()
    try:
        hvd_trainer.init(timeout_seconds=float(env.get("HVD_TEST_PG_TIMEOUT", 60)))
        reply: tuple[str, Any] = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        reply = ("error", traceback.format_exc())
    finally:
        try:
            hvd_trainer.shutdown()
        except Exception:  # noqa: BLE001
            reply = ("error", traceback.format_exc()) if reply[0] == "ok" else reply
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return reply


def _reported(results: dict[int, tuple[str, Any]]) -> str:
    """The errors the other ranks did report, for a run that failed on a hung or dead rank."""
    errors = {r: v for r, (status, v) in sorted(results.items()) if status == "error"}
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in errors.items())


@dataclass(eq=False)
class _Pool:
    """``size`` rank processes started with ``env``; tasks go to each, results come back on one queue."""

    size: int
    env: dict[str, str]
    procs: list = field(default_factory=list)
    tasks: list = field(default_factory=list)
    results: Any = None
    stacks_path: str = ""
    """Where each rank writes its stacks if the current run's time runs out (``{rank}`` in it)."""

    def start(self) -> _Pool:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.size)]
        self.procs = [
            ctx.Process(target=_serve, args=(r, self.size, self.env, self.tasks[r], self.results),
                        name=f"rank-{r}-of-{self.size}")
            for r in range(self.size)
        ]
        for p in self.procs:
            p.start()
        return self

    def alive(self) -> bool:
        return all(p.exitcode is None for p in self.procs)

    def run(self, task_id: int, fn: Callable, args: tuple,
            timeout_seconds: float) -> dict[int, tuple[str, Any]]:
        port = free_port()
        with tempfile.TemporaryDirectory(prefix="hvd-test-stacks-") as tmp:
            self.stacks_path = os.path.join(tmp, "rank{rank}.txt")
            for q in self.tasks:
                q.put((task_id, port, fn, args, time.time() + timeout_seconds, self.stacks_path))
            return self._collect(task_id, timeout_seconds)

    def _stacks(self, ranks: list[int]) -> str:
        """The stacks ``ranks`` wrote when their time ran out (nothing for a rank that wrote none)."""
        out = []
        for r in ranks:
            with contextlib.suppress(OSError), open(self.stacks_path.format(rank=r)) as f:
                text = f.read()
                if text:
                    out.append(f"\n--- rank {r}: stacks {_STACKS_BEFORE_SECONDS:g} s before the timeout ---\n"
                               f"{text}")
        return "".join(out)

    def _collect(self, task_id: int, timeout_seconds: float) -> dict[int, tuple[str, Any]]:
        """Results by rank; raises AssertionError naming ranks that hang or die without a result."""
        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_seconds
        while len(results) < self.size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.size)) - set(results))
                raise AssertionError(f"ranks {missing} did not finish within {timeout_seconds}s"
                                     f"{_reported(results)}{self._stacks(missing)}")
            try:
                self._take(task_id, results, min(remaining, 1.0))
                continue
            except queue.Empty:
                pass
            dead = {r: p for r, p in enumerate(self.procs) if r not in results and p.exitcode is not None}
            if dead:
                for p in dead.values():
                    p.join()
                self._drain(task_id, results)  # a result sent just before dying still counts
                codes = {r: p.exitcode for r, p in dead.items() if r not in results}
                if codes:
                    raise AssertionError(f"ranks died without a result: exit codes {codes}"
                                         f"{_reported(results)}{self._stacks(sorted(codes))}")
        return results

    def _take(self, task_id: int, results: dict, timeout: float) -> None:
        got_id, rank, status, value = self.results.get(timeout=timeout)
        if got_id == task_id:
            results[rank] = (status, value)

    def _drain(self, task_id: int, results: dict) -> None:
        # The queue's feeder thread in a worker that exited has flushed: what it sent is readable.
        while True:
            try:
                self._take(task_id, results, 0.2)
            except queue.Empty:
                return

    def stop(self) -> None:
        """End the workers: politely when idle, killed when they do not exit within 5 s."""
        for q in self.tasks:
            with contextlib.suppress(OSError, ValueError):  # a queue already closed
                q.put(None)
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for q in [*self.tasks, self.results]:
            q.close()
            q.cancel_join_thread()


_pools: OrderedDict[tuple, _Pool] = OrderedDict()
_task_ids = itertools.count()


def _pool_for(world_size: int, env: dict[str, str]) -> _Pool:
    key = (world_size, tuple(sorted(env.items())))
    pool = _pools.pop(key, None)
    if pool is not None and not pool.alive():
        pool.stop()
        pool = None
    if pool is None:
        pool = _Pool(world_size, dict(env)).start()
    _pools[key] = pool
    while len(_pools) > MAX_IDLE_POOLS:
        _pools.popitem(last=False)[1].stop()
    return pool


def _discard(pool: _Pool) -> None:
    for key, p in list(_pools.items()):
        if p is pool:
            del _pools[key]
    pool.stop()


@atexit.register
def stop_pools() -> None:
    """Stop every kept pool (at interpreter exit, before multiprocessing joins its children)."""
    while _pools:
        _pools.popitem()[1].stop()


def run_workers(
    fn: Callable,
    world_size: int = 2,
    *,
    args: tuple = (),
    env: dict[str, str] | None = None,
    timeout_seconds: float = 90.0,
    fresh_processes: bool = False,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` rank processes; return the results in rank order.

    Args:
        fn: a module-level function (sent by name); it runs after ``hvd_trainer.init()``.
        world_size: number of ranks.
        args: picklable arguments, the same for every rank.
        env: variables set in the rank processes before anything is imported; runs with equal
            ``(world_size, env)`` share rank processes.
        timeout_seconds: the whole run's limit, seconds.
        fresh_processes: spawn processes for this run alone (a test that must own them).

    Raises:
        AssertionError: a worker raised (its traceback is included), died, or did not finish
            within ``timeout_seconds`` (the missing ranks are named).
    """
    env = dict(env or {})
    pool = _Pool(world_size, env).start() if fresh_processes else _pool_for(world_size, env)
    ok = False
    try:
        results = pool.run(next(_task_ids), fn, args, timeout_seconds)
        errors = {r: v for r, (s, v) in results.items() if s == "error"}
        if errors:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"worker(s) failed:\n{text}")
        ok = True
        return [results[r][1] for r in range(world_size)]
    finally:
        if fresh_processes or not ok:
            _discard(pool)

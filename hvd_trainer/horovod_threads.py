"""``horovod.runner.util.threads`` for Horovod programs and test helpers under the alias.

Horovod's own test helpers (``test/utils/common.py``) and some launch scripts import these three
functions; :mod:`hvd_trainer.horovod_alias` serves this module under that name. Standard library
threads only.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["in_thread", "on_event", "execute_function_multithreaded"]


def in_thread(target: Callable[..., Any], args: tuple = (), name: str | None = None,
              daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Start ``target(*args)`` in a new thread and return the started thread.

    ``silent``: exceptions of ``target`` are swallowed instead of reaching ``threading.excepthook``.

    Raises:
        ValueError: ``args`` is not a tuple (Horovod's rule: one argument is ``(arg,)``).
    """
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args).__name__}; for one argument use (arg,)")

    def quiet(*a: Any) -> None:
        with contextlib.suppress(Exception):  # the caller asked for silence
            target(*a)

    thread = threading.Thread(target=quiet if silent else target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def on_event(event: threading.Event, func: Callable[..., Any], args: tuple = (),
             stop: threading.Event | None = None, check_stop_interval_s: float = 1.0,
             daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Run ``func(*args)`` in a thread once ``event`` is set; give up when ``stop`` is set first
    (checked every ``check_stop_interval_s`` seconds). Returns the started thread.

    Raises:
        ValueError: ``args`` is not a tuple.
    """
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args).__name__}; for one argument use (arg,)")

    def wait_then_run() -> None:
        while not event.wait(check_stop_interval_s if stop is not None else None):
            if stop is not None and stop.is_set():
                return
        func(*args)

    return in_thread(wait_then_run, name=f"on-event-{getattr(func, '__name__', 'func')}", daemon=daemon,
                     silent=silent)


def execute_function_multithreaded(fn: Callable[..., Any], args_list: Sequence[Sequence[Any]],
                                   block_until_all_done: bool = True,
                                   max_concurrent_executions: int = 1000) -> dict[int, Any] | None:
    """Call ``fn(*args_list[i])`` for every ``i`` on at most ``max_concurrent_executions`` threads.

    Returns ``{i: result}`` when ``block_until_all_done`` (else ``None`` at once).

    Raises:
        RuntimeError: a call raised (its exception is the cause), when blocking.
    """
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(args_list)):
        todo.put(i)
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def work() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = fn(*args_list[i])
            except BaseException as exc:  # noqa: BLE001 - reported by the caller's thread
                errors.append(exc)

    threads = [in_thread(work, daemon=not block_until_all_done)
               for _ in range(max(1, min(max_concurrent_executions, len(args_list))))]
    if not block_until_all_done:
        return None
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(args_list)} calls of {getattr(fn, '__name__', fn)} "
                           "raised") from errors[0]
    return results

"""``@elastic.run``: resume a training function from its last commit after a restart.

How recovery works here (different from Horovod, which re-initialised inside the same
processes): when a worker dies, torchrun's elastic agent (``hvdrun --min-np/--max-np`` or
``--max-restarts``) stops every worker and starts them all again as new processes, up to
``--max-restarts`` times. In each new process the decorated function

1. joins the (new) world with :func:`hvd_trainer.init`,
2. loads the last commit from ``<checkpoint_dir>/elastic_state.pt`` on each node's local
   rank 0 if it exists (written there at every ``state.commit()``, atomically and in the
   background, so the file is always a complete commit: the newest one whose write finished),
3. broadcasts the newest of those commits to every rank (``state.sync(root_rank=...)``), runs
   the reset callbacks when it resumed, and
4. calls the function, which continues from ``state.epoch``/``state.step``/the sampler.

Steps after the last persisted commit are redone (a worker killed while its last commit was
still being written resumes from the one before). When the function returns normally it waits
for the last commit to reach the file (``state.flush()``). Only failures a restart can cure are
retried: an exception of the function itself (not a peer's failure, see
:func:`hvd_trainer.elastic.user_error.is_peer_failure`) is recorded for hvdrun, which then
fails the job at once with that exception's text instead of restarting it. With the default
directory (the system temp dir keyed by torchrun's run id) the file is removed when the
function returns normally on every rank; an explicit ``checkpoint_dir`` keeps it.

In-process recovery (``hvdrun --min-np/--max-np --recovery in-process``), as Horovod's elastic
mode did it: the processes that survive a lost rank are not restarted. When the function raises
a peer's failure (``RankFailedError``, a broken transport), every survivor drops its process
group, agrees with the others on the new membership through the job's store
(:func:`hvd_trainer.comm.recover`), returns to its last commit **in memory**, takes the newest
commit any survivor holds (broadcast), runs the reset callbacks and calls the function again in
the same process; the sampler deals the rest of the epoch over the new world. The lost worker is
restarted alone by hvdrun's worker entry and joins at the survivors' next ``commit()``, which
raises ``HostsUpdatedInterrupt`` on every rank (no restore: the commit is current); the joiner
receives the state by broadcast from a survivor, not from the file. A member lost while the
world re-forms (a restarted worker killed again during its join) makes the others re-form once
more without it. Commit every step: at most that step is redone.

Example::

    state = elastic.TorchState(model, optimizer, epoch=0, sampler=sampler)

    @elastic.run(checkpoint_dir="runs/exp1")
    def train(state):
        for epoch in range(state.epoch, epochs):
            ...
            state.epoch = epoch + 1   # commit what a restart should start from
            state.commit()

    train(state)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from hvd_trainer.checkpoint import discard
from hvd_trainer.comm import (
    PEER_FAILED_EXIT_CODE,
    HostsUpdatedInterrupt,
    TorchElasticEnv,
    World,
    allgather_object,
    barrier,
    finish_job,
    first_survivor,
    get_world,
    in_process_recovery,
    init,
    recover,
    torchelastic_env,
)
from hvd_trainer.elastic.state import STATE_FILENAME, State
from hvd_trainer.elastic.user_error import is_peer_failure, record_user_error

__all__ = ["run", "default_checkpoint_dir"]

F = TypeVar("F", bound=Callable[..., Any])
_log = logging.getLogger(__name__)


def default_checkpoint_dir(elastic_env: TorchElasticEnv | None = None) -> Path | None:
    """``<tmp>/hvd_trainer_elastic/<TORCHELASTIC_RUN_ID>``, or ``None`` without a usable run id.

    The one rule for the automatic commit directory (``@elastic.run`` and the Lightning
    strategy's elastic fit). torchrun's static rendezvous uses the run id ``"none"`` for every
    job, which cannot tell two jobs apart, so no default is given then (``@elastic.run`` keeps
    commits in memory with a warning; the Lightning fit falls back to its root directory).

    Args:
        elastic_env: torchrun's variables (default: read them, :func:`torchelastic_env`).
    """
    env = torchelastic_env() if elastic_env is None else elastic_env
    if not env.unique_run_id:
        return None
    return Path(tempfile.gettempdir()) / "hvd_trainer_elastic" / env.run_id


def _resume(state: State, directory: Path | None) -> World:
    world = init()
    path = None if directory is None else directory / STATE_FILENAME
    state.attach_file(path, writer=world.local_rank == 0)
    world = _sync_or_reform(state, world)
    if state.commit_count > 0:
        state.on_reset()
    return world


def _sync_newest(state: State, world: World) -> None:
    """Make every rank hold the newest commit any rank has: in memory (survivors of an
    in-process recovery), else from the file read by each host's local rank 0 (a restart).
    Survivors and a joiner both come through here, so they run the same collectives."""
    counts = allgather_object(state.commit_count, name="elastic.run.commits", world=world)
    if max(counts) == 0:  # nobody holds a commit in memory: read the file, if any
        loaded = world.local_rank == 0 and state.load_committed()
        counts = allgather_object(state.commit_count if loaded else 0, name="elastic.run.commits",
                                  world=world)
    root = max(range(len(counts)), key=lambda r: (counts[r], -r))  # newest; lowest rank on a tie
    state.sync(world=world, root_rank=root)  # carries the commit count: every rank knows whether it resumed


def _sync_or_reform(state: State, world: World) -> World:
    """:func:`_sync_newest`; with in-process recovery, when a member is lost during it (a restarted
    worker killed while it joins, a survivor lost while a joiner syncs), re-form the world without
    it and sync again, as often as that happens. Returns the world the state was synced over."""
    while True:
        try:
            _sync_newest(state, world)
            return world
        except Exception as exc:
            if not (in_process_recovery() and is_peer_failure(exc)):
                raise
            _log.warning("elastic: a member was lost while the world re-formed (%s); re-forming again",
                         type(exc).__name__)
            world = recover()
            state.restore()  # the failed sync applied nothing, or the newest commit in full


def _recover_in_process(state: State, exc: BaseException) -> World:
    """Re-form the world in this process after ``exc`` (a peer's failure, or a joiner waiting)
    and continue from the newest commit (see the module docstring)."""
    start = time.monotonic()
    old = get_world()
    joiner = isinstance(exc, HostsUpdatedInterrupt)
    world = recover()
    if not joiner:
        state.restore()  # back to this rank's last commit; the newest one is then broadcast
    world = _sync_or_reform(state, world)
    state.on_reset()
    if first_survivor():  # rank 0 may be the worker that just joined
        why = "a worker joined" if joiner else f"{type(exc).__name__}"
        _log.warning("elastic: world re-formed in process (%s): %d -> %d ranks in %.2f s, resuming "
                     "from commit %d", why, old.size, world.size, time.monotonic() - start,
                     state.commit_count)
    return world


def run(func: F | None = None, *, checkpoint_dir: str | os.PathLike[str] | None = None) -> Any:
    """Decorate ``func(state, *args, **kwargs)`` to resume from the last persisted commit.

    Use as ``@run`` or ``@run(checkpoint_dir=...)``. The first argument must be a
    :class:`~hvd_trainer.elastic.state.State`.

    Raises:
        TypeError: the first argument is not a ``State``.
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(state, State):
                raise TypeError(
                    f"@elastic.run expects a State as first argument, got {type(state).__name__}. "
                    "HINT: train(TorchState(model, optimizer, epoch=0))."
                )
            explicit = checkpoint_dir is not None
            directory = Path(checkpoint_dir) if explicit else default_checkpoint_dir()
            if directory is None:
                warnings.warn(
                    "elastic.run has no checkpoint_dir and torchrun gave no unique run id: commits "
                    "stay in memory and are lost when workers restart. HINT: pass "
                    "checkpoint_dir=... or launch with hvdrun --min-np/--max-np.",
                    stacklevel=2,
                )
            world = _resume(state, directory)
            while True:
                try:
                    result = fn(state, *args, **kwargs)
                    break
                except Exception as exc:
                    if in_process_recovery() and is_peer_failure(exc):
                        world = _recover_in_process(state, exc)
                        continue
                    record_user_error(exc, rank=world.rank)  # a peer's failure is not recorded
                    _stop_for_restart(exc, world)
                    raise
            finish_job()  # a restarted worker still waiting to join has nothing left to do
            state.flush()  # the file holds the last commit before the function counts as done
            if not explicit and directory is not None:
                _cleanup(directory, world)
            return result

        return wrapper  # type: ignore[return-value]

    return decorate(func) if func is not None else decorate


def _stop_for_restart(exc: BaseException, world: World) -> None:
    """A peer's failure with a restart left: say so in one line (its traceback would only repeat
    the lost peer) and exit with :data:`PEER_FAILED_EXIT_CODE`; the agent restarts every worker
    and the function resumes from the last commit. Returns (the caller re-raises) otherwise:
    the last attempt's failure keeps its traceback.

    Raises:
        SystemExit: ``PEER_FAILED_EXIT_CODE``, after the line.
    """
    env = torchelastic_env()
    if not (env.under_agent and env.restart_count < env.max_restarts and is_peer_failure(exc)):
        return
    what = " ".join(str(exc).split(" HINT:")[0].split())[:300]
    _log.warning("elastic: rank %d stopped: %s: %s; the workers restart from the last commit "
                 "(restart %d of %d)", world.rank, type(exc).__name__, what, env.restart_count + 1,
                 env.max_restarts)
    raise SystemExit(PEER_FAILED_EXIT_CODE) from None


def _cleanup(directory: Path, world: World) -> None:
    """Remove the automatic directory's commit (with any temporary file of a write that was
    killed) and the directory (and ``hvd_trainer_elastic/``
    when no other job's directory is in it): nothing is left in the temp folder."""
    barrier(world=world)  # every rank finished: the commit is no longer needed
    if world.local_rank == 0:
        discard(directory / STATE_FILENAME)  # and a write a kill interrupted
        for folder in (directory, directory.parent):
            with contextlib.suppress(OSError):  # not empty: another job's files are still there
                folder.rmdir()

"""Elastic mode of ``Trainer(strategy="horovod")``: commit during ``fit``, resume after a restart
or, with in-process recovery, continue ``fit`` in the surviving processes.

When a worker dies, torchrun's elastic agent (``hvdrun --min-np/--max-np`` or
``--max-restarts N``) stops every worker and starts the script again in new processes,
up to ``max_restarts`` times. In elastic mode the strategy makes such a restart continue
where the job was instead of starting over:

1. **Commit**: every ``commit_every_n_steps`` optimizer steps and at each epoch end, a full
   Lightning checkpoint (model, optimizers, LR schedulers, loops, callbacks, precision plugin,
   training-loader position) is snapshotted in memory by each node's local rank 0 (every
   tensor copied to CPU before training goes on) and written atomically to
   ``<dir>/lightning_fit<k>.ckpt`` (``k``: the process's ``k``-th elastic ``fit`` call) on a
   background thread (:mod:`hvd_trainer.elastic.persist`), so a commit costs about an
   in-memory copy. The file is always one complete commit (a kill during a write leaves the
   previous one); ``fit`` waits for the last write before it ends.
2. **Resume**: in a restarted attempt (``TORCHELASTIC_RESTART_COUNT > 0``), if ``fit`` got no
   ``ckpt_path`` and a commit of this run exists, the newest commit found on any node is
   broadcast from its node and restored before the strategy's setup, exactly as
   ``fit(ckpt_path=...)`` would; rank 0 logs which file and step it resumed from. An
   exception of the user's code during ``fit`` (not a peer's failure) is recorded for hvdrun
   (:mod:`hvd_trainer.elastic.user_error`), which fails the job instead of restarting it.
3. **Mid-epoch**: the training DataLoader becomes a
   :class:`~hvd_trainer.elastic.resumable_loader.ResumableDataLoader`, so a resumed epoch
   continues at the next batch and no sample is seen twice or skipped, also on another number
   of ranks (the samples of the epoch no rank trained yet are dealt over the new ranks). For a loader that
   cannot be resumed exactly, commits happen only at epoch ends (a warning says why).
4. **Random numbers**: each commit also holds every rank's global RNG states (torch CPU and
   CUDA, numpy, Python ``random``; :mod:`hvd_trainer.elastic.rng_state`) as they were right after the
   committed optimizer step, gathered to the writers. A resumed rank restores its own (by global
   rank) where the uninterrupted run would continue drawing: before the training loader's
   iterator is created when the commit is at an epoch boundary (so a random sampler's order and
   the loader's worker seed are drawn again the same way), else after the resumed epoch's
   iterator was created (the strategy's ``on_train_start``; Lightning fetches a sized loader's
   batches only when it trains them, so augmentation in the main process repeats too). A random
   training sampler resumed mid-epoch draws its epoch's order again from the generator states
   it drew it from (recorded per rank by :class:`~hvd_trainer.elastic.resumable_loader.ResumableSampler`).
   So dropout and other random draws continue bit-identically. A commit made with another world
   size resumes without restoring random states (a warning says so).

The first attempt (``TORCHELASTIC_RESTART_COUNT`` 0 or unset) deletes an old commit at the
same path, so a new job never resumes from an earlier job's state.

No step commit is made after an epoch's last batch: the epoch-end commit follows it (after
validation), and Lightning starts the epoch after a resume from a last-batch checkpoint without
counting it as started, so a later mid-epoch commit of that epoch would not resume mid-epoch.

**In-process recovery** (``hvdrun --min-np/--max-np --recovery in-process``; elastic mode is then
on by default): the processes that survive a lost rank are not restarted, as in Horovod's
elastic mode. The strategy's Lightning launcher (:class:`InProcessFitLauncher`) runs ``fit`` and,
when it raises a peer's failure (:func:`~hvd_trainer.elastic.user_error.is_peer_failure`:
``RankFailedError``, a broken transport), releases the failed run (as Lightning does after an
exception, without the ``on_exception`` hooks), agrees on the new membership with the other
survivors (:func:`hvd_trainer.comm.recover`: ranks renumbered, the size may change) and runs
``fit`` again in the same process with the same arguments. The strategy then follows the new
world (its ranks, ``world_size`` and so Lightning's ``DistributedSampler``, the gradient reducer
and every collective: the next ``setup`` rebuilds them), and :meth:`ElasticFit.start` restores the
newest commit any rank holds **in memory**: each rank keeps its own last commit (every rank
snapshots, no file is written), the ranks allgather their commit counts and the lowest rank
holding the newest broadcasts it; it is restored as ``fit(ckpt_path=...)`` would
(``trainer.ckpt_path`` reads :data:`MEMORY_CHECKPOINT`). A commit is also made when training
starts, so a failure before the first step commit returns to the start. The training loader
deals the samples of the interrupted epoch that no rank trained yet over the new world
(:mod:`hvd_trainer.elastic.resumable_loader`: no sample of the epoch is skipped or trained twice)
and the epoch continues at the batch index from which those batches end it. Random states are
restored by rank when the world size did not change; when it did, each survivor restores its own
states of the commit (so the steps it redoes draw what they drew before) and a restarted worker
keeps its new process's.

The lost worker is started again alone by hvdrun's worker entry; its ``hvd_trainer`` init joins
through the same membership rounds, and every commit is a step boundary where the members check
:func:`hvd_trainer.comm.reform_due`: at the same commit on every rank they raise
``HostsUpdatedInterrupt`` (after taking the commit), which the launcher handles like a failure,
and the joiner's own first ``fit`` runs the same collectives, so it receives the newest commit by
broadcast from a survivor. A restarted worker must join in the script's same ``fit`` call (a
``RuntimeError`` says so otherwise). When ``fit`` ends, a restarted worker still waiting to join
ends with status 0 (:func:`hvd_trainer.comm.finish_job`). An exception of the user's code (not a
peer's failure) still ends the job at once, as described above. Callbacks of the survivors see
``setup``/``on_fit_start``/``on_train_start`` again when ``fit`` runs again (as after any
``fit`` resumed from a checkpoint), without ``teardown`` in between. With ``zero_stage`` a
commit holds the full optimizer state on every rank (the shards are gathered), and the next
``fit``'s setup plans the shards for the new world before the commit is restored into them.

Directory: ``elastic_checkpoint_dir`` if given (kept after the job); otherwise
``<tmp>/hvd_trainer_elastic/<TORCHELASTIC_RUN_ID>`` (what ``hvdrun`` gives: a fresh run id per
job; the rule of :func:`hvd_trainer.elastic.default_checkpoint_dir`), or
``<trainer.default_root_dir>/hvd_elastic`` when torchrun gave no unique run id (static
rendezvous). Automatic directories lose their commit file when ``fit`` ends normally.

Environment (set by torchrun, read through :func:`hvd_trainer.comm.base.launch_env.torchelastic_env`):
``TORCHELASTIC_MAX_RESTARTS`` (elastic mode is on by default when > 0),
``TORCHELASTIC_RESTART_COUNT`` (the attempt), ``TORCHELASTIC_RUN_ID`` (the default directory
and a guard against foreign commits); and by hvdrun: ``HVDRUN_RECOVERY=in-process`` (in-process
recovery, read through :func:`hvd_trainer.comm.base.launch_env.recovery_env`).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.trainer.states import RunningStage, TrainerFn, TrainerStatus
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn

import hvd_trainer.comm as comm
from hvd_trainer.checkpoint import discard, load_checkpoint
from hvd_trainer.comm import recovery_env, torchelastic_env
from hvd_trainer.elastic.persist import BackgroundWriter, PersistError, snapshot_to_cpu
from hvd_trainer.elastic.resumable_loader import ResumableDataLoader, ResumableSampler, make_resumable
from hvd_trainer.elastic.rng_state import capture_rng_states, restore_rng_states
from hvd_trainer.elastic.run import default_checkpoint_dir
from hvd_trainer.elastic.user_error import is_peer_failure, record_user_error
from hvd_trainer.lightning._compat import (
    dump_checkpoint,
    has_loaded_checkpoint,
    restore_modules_and_callbacks,
    teardown_failed_run,
)

__all__ = ["ElasticFitConfig", "ElasticFit", "InProcessFitLauncher", "COMMIT_KEY", "MEMORY_CHECKPOINT",
           "in_process_launch"]

log = logging.getLogger(__name__)

COMMIT_KEY = "hvd_trainer_elastic"
"""Checkpoint key of the commit's metadata: ``commit``, ``run_id``, ``global_step``, ``epoch``,
``batch`` (batches of ``epoch`` done), ``world_size``, ``rng`` (every rank's RNG states, a list
indexed by global rank; see :mod:`hvd_trainer.elastic.rng_state`; plus ``sampler``: the
:attr:`~hvd_trainer.elastic.resumable_loader.ResumableSampler.epoch_rng` of a random training sampler)."""

_WRITER = BackgroundWriter()
"""Writes every elastic fit's commits of this process (so a later fit can wait for an earlier one's)."""

_FIT_CALLS = itertools.count()  # k in lightning_fit<k>.ckpt: the same k in every attempt

MEMORY_CHECKPOINT = "<hvd_trainer elastic commit in memory>"
"""The ``ckpt_path`` Lightning reports (``trainer.ckpt_path``) for a fit resumed in process from
an in-memory commit (no file is read)."""


def in_process_launch() -> bool:
    """Whether hvdrun started this worker for in-process recovery (``hvdrun --recovery in-process``
    under torchrun's agent), read from the environment (before ``init``).

    Raises:
        LaunchEnvError: ``HVDRUN_RECOVERY`` or a count hvdrun sets is malformed.
    """
    return recovery_env().in_process and torchelastic_env().under_agent


@dataclass(kw_only=True, slots=True)
class ElasticFitConfig:
    """Validated elastic arguments of :class:`~hvd_trainer.strategy.HorovodStrategy`."""

    enabled: bool | None = None
    """``None``: on when torchrun may restart workers (``TORCHELASTIC_MAX_RESTARTS > 0``)."""
    checkpoint_dir: Path | None = None
    """Where commits go; ``None``: automatic (see the module docstring)."""
    commit_every_n_steps: int = 100
    """Optimizer steps between mid-epoch commits; 0: commit at epoch ends only."""


class ElasticFit:
    """Commit/resume bookkeeping of one elastic ``fit`` (created by the strategy's ``setup``).

    Args:
        config: the strategy's elastic arguments.
        trainer: the fitting Trainer.
        world: the world to commit and resume over (default: the initialised one).
    """

    def __init__(
        self, config: ElasticFitConfig, trainer: pl.Trainer, world: comm.World | None = None
    ) -> None:
        self.world = comm.get_world() if world is None else world
        env = torchelastic_env()
        max_restarts, self.attempt, self.run_id = env.max_restarts, env.restart_count, env.run_id
        self._unique_run_id = env.unique_run_id
        self.automatic = config.checkpoint_dir is None
        directory = (config.checkpoint_dir or default_checkpoint_dir(env)
                     or Path(trainer.default_root_dir) / "hvd_elastic")
        self.fit_index = next(_FIT_CALLS)
        """This fit's place among the process's elastic fits (``k``)."""
        self.path = directory / f"lightning_fit{self.fit_index}.ckpt"
        self.every = config.commit_every_n_steps
        self.mid_epoch = self.every > 0
        """False once the training loader turned out not to be resumable mid-epoch."""
        self.commits = 0
        self.in_process = comm.in_process_recovery()
        """The world was formed for in-process recovery: every rank keeps its commits in memory
        (no file), and a fit that lost a peer continues in this process (:class:`InProcessFitLauncher`)."""
        self.recovering = False
        """Set by the launcher after it re-formed the world: the strategy's next setup keeps this
        object (its commits) and :meth:`start` resumes from the newest commit in memory."""
        self._memory: dict[str, Any] | None = None
        """This rank's last commit (in-process recovery)."""
        self._commit_rank: int | None = None
        """This rank's rank in the world that took the commit in ``_memory`` (``None``: the
        commit came by broadcast, to a restarted worker): which of its RNG states are its own."""
        self.resumed_world_size: int | None = None
        """The world size the commit this fit resumed from was taken in (``None``: not resumed,
        or already used by the strategy to rescale learning rates)."""
        self._last_step = -1
        self._loaded: dict[str, Any] | None = None
        self._loaded_path: str | None = None
        self._rng: dict[str, Any] | None = None
        """This rank's RNG states of the resumed commit, until restored."""
        self._rng_before_loader = False
        """Restore them before the training iterator exists (epoch-boundary commit)."""
        self._sampler: ResumableSampler | None = None
        """The resumable training loader's sampler (its epoch's random-sampler states are committed)."""
        if max_restarts == 0 and not self.in_process:
            rank_zero_warn(
                f"HorovodStrategy(elastic=True) but torchrun will not restart workers "
                f"(TORCHELASTIC_MAX_RESTARTS={max_restarts}): commits are written to {self.path} "
                "but only a restarted attempt resumes from them. HINT: launch with "
                "hvdrun --min-np/--max-np or --max-restarts N."
            )

    # -- start of fit ----------------------------------------------------------------------
    def start(self, trainer: pl.Trainer) -> None:
        """Install the commit callback; in a restarted attempt restore the newest commit; with
        in-process recovery restore the newest commit any rank holds in memory, if one does.

        Call at the start of ``strategy.setup`` (before the model is moved or wrapped).

        Raises:
            RuntimeError: (in-process recovery) a restarted worker joined in another ``fit`` call
                of the script than the one the others are in.
        """
        trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, _ElasticCommit)]
        trainer.callbacks.append(_ElasticCommit(self))
        _WRITER.flush()  # an earlier fit of this process that raised may still be writing its commit
        world = self.world
        self.recovering = False
        if self.in_process:
            newest = self._newest_in_memory(world)
            if newest is not None:
                self._resume(trainer, newest, MEMORY_CHECKPOINT, world)
                return
        if self.attempt == 0:
            if world.local_rank == 0:
                self.path.unlink(missing_ok=True)  # an earlier job's commit is not ours
            comm.barrier(world=world)
            return
        if trainer.ckpt_path is not None or has_loaded_checkpoint(trainer):
            rank_zero_info(f"hvd_trainer elastic: fit(ckpt_path={trainer.ckpt_path!r}) given; "
                           "not resuming from the elastic commit.")
            return
        loaded = self._newest_commit(world)
        if loaded is None:
            rank_zero_info(f"hvd_trainer elastic: attempt {self.attempt}, no commit at {self.path}; "
                           "training from the start.")
            return
        self._resume(trainer, loaded, str(self.path), world)

    def _resume(self, trainer: pl.Trainer, loaded: dict[str, Any], path: str, world: comm.World) -> None:
        """Restore ``loaded`` (read from ``path``, or :data:`MEMORY_CHECKPOINT`) as
        ``fit(ckpt_path=path)`` would: modules and callbacks now, the rest by Lightning."""
        meta = loaded[COMMIT_KEY]
        self.commits = int(meta["commit"])
        self.resumed_world_size = int(meta.get("world_size", world.size))
        self._loaded, self._loaded_path = loaded, path
        restore_modules_and_callbacks(trainer, path)  # loads via take_loaded()
        self._take_rng(meta, world)
        how = (f"resumed in process on {world.size} rank(s) from the newest commit in memory"
               if path == MEMORY_CHECKPOINT else f"attempt {self.attempt} resumed from {path}")
        rank_zero_info(
            f"hvd_trainer elastic: {how} (commit "
            f"{meta['commit']}, global step {meta['global_step']}, epoch {meta['epoch']}, "
            f"batch {meta['batch']} of that epoch)"
        )

    def _newest_in_memory(self, world: comm.World) -> dict[str, Any] | None:
        """The newest commit any rank holds in memory, broadcast from the lowest rank holding it
        (a survivor of a lost rank, to the others and to a restarted worker), or ``None`` when no
        rank holds one (the job's first start). One allgather, then one broadcast if found."""
        mine = (self.fit_index, 0 if self._memory is None else self.commits)
        found = comm.allgather_object(mine, name="elastic.lightning.memory", world=world)
        if len({fit for fit, _ in found}) > 1:
            raise RuntimeError(
                "hvd_trainer elastic: a restarted worker joined in the script's elastic fit call "
                f"#{mine[0]} but the ranks are in fit calls {sorted({f for f, _ in found})} "
                f"(by rank: {[f for f, _ in found]}); in-process recovery resumes the fit it "
                "interrupted only. HINT: call trainer.fit once per script with --recovery in-process, "
                "or use hvdrun --recovery restart."
            )
        newest = max(count for _, count in found)
        if newest == 0:
            return None
        src = min(r for r, (_, count) in enumerate(found) if count == newest)
        held = comm.broadcast_object(self._memory if world.rank == src else None, src,
                                     name="elastic.lightning.commit", world=world)
        if mine[1] != newest:  # not this rank's own commit: none of its RNG states is this process's
            self._commit_rank = None
        self._memory = held
        return copy.deepcopy(held)  # Lightning's restore may keep tensors of what it is given

    def _take_rng(self, meta: dict[str, Any], world: comm.World) -> None:
        states = meta.get("rng")
        if states is None:
            return
        if len(states) != world.size and self.in_process:
            rank_zero_info(f"hvd_trainer elastic: the commit was made by {len(states)} ranks, the world "
                           f"has {world.size} now: each rank that took it restores its own random "
                           "states of it; a restarted worker goes on from its own process's.")
            if self._commit_rank is not None and self._commit_rank < len(states):
                self._rng = states[self._commit_rank]
                self._rng_before_loader = int(meta["batch"]) == 0
            return
        if len(states) != world.size:
            rank_zero_warn(
                f"hvd_trainer elastic: the commit at {self.path} was made by {len(states)} ranks, this "
                f"attempt has {world.size}: random number generators are not restored, so dropout, "
                "random samplers and augmentation draw other numbers than an uninterrupted run."
            )
            return
        self._rng = states[world.rank]
        self._rng_before_loader = int(meta["batch"]) == 0

    def restore_rng(self, *, before_loader: bool) -> None:
        """Restore this rank's committed RNG states once, at the point the commit stands for.

        Called with ``before_loader=True`` when the training loader is processed (before its
        iterator draws a seed) and with ``False`` from the strategy's ``on_train_start`` (after
        the resumed epoch's iterator was created and its first batch prefetched).
        """
        if self._rng is not None and before_loader == self._rng_before_loader:
            restore_rng_states(self._rng)
            self._rng = None

    def take_loaded(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The commit read by :meth:`start` if ``path`` is where it came from (once), else ``None``."""
        if self._loaded is None or str(path) != self._loaded_path:
            return None
        loaded, self._loaded = self._loaded, None
        return loaded

    def _newest_commit(self, world: comm.World) -> dict[str, Any] | None:
        """Every node's local rank 0 reads its copy; the newest one of this run is broadcast."""
        mine = None
        if world.local_rank == 0 and self.path.exists():
            mine = load_checkpoint(self.path)
            meta = mine.get(COMMIT_KEY, {})
            if self._unique_run_id and meta.get("run_id") != self.run_id:
                mine = None  # left by another job
        counts = comm.allgather_object(None if mine is None else mine[COMMIT_KEY]["commit"], world=world)
        found = [(c, -r) for r, c in enumerate(counts) if c is not None]
        if not found:
            return None
        src = -max(found)[1]
        return comm.broadcast_object(mine if world.rank == src else None, src, world=world)

    # -- during fit ------------------------------------------------------------------------
    def adapt_loader(self, dataloader: object, trainer: pl.Trainer) -> object:
        """The training loader, made resumable mid-epoch where exact (else epoch-end commits)."""
        if trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        self.restore_rng(before_loader=True)
        resumable, reason = make_resumable(dataloader, lambda: _position(trainer),
                                           lambda start: _continue_epoch_at(trainer, start))
        if isinstance(resumable, ResumableDataLoader):
            self._sampler = resumable.sampler
            if self._rng is not None and not self._rng_before_loader:  # resuming mid-epoch
                self._sampler.replay(self._rng.get("sampler"))
        if reason is not None and self.mid_epoch:
            self.mid_epoch = False
            rank_zero_warn(
                f"hvd_trainer elastic: the training loader cannot resume mid-epoch exactly: {reason}. "
                "Committing at epoch ends only. HINT: a torch DataLoader(dataset, batch_size=...) "
                "with use_distributed_sampler=True (the default) resumes mid-epoch."
            )
        return resumable

    def commit(self, trainer: pl.Trainer) -> None:
        """Snapshot the full checkpoint on each node's local rank 0; write it in the background.

        Every rank's RNG states (about 12 KB each) are allgathered first (this also keeps the
        ranks in step), so each writer stores all of them. Returns once the snapshot is taken;
        :meth:`flush` waits for the file. With in-process recovery every rank keeps the snapshot
        in memory instead (no file), and a commit is where a restarted worker is let in: every
        rank raises ``HostsUpdatedInterrupt`` at the same commit, after taking it.

        Raises:
            PersistError: the previous background write failed.
            HostsUpdatedInterrupt: (in-process recovery) a restarted worker waits to join.
        """
        world = self.world
        mine = capture_rng_states()
        mine["sampler"] = None if self._sampler is None else self._sampler.epoch_rng
        rng = comm.allgather_object(mine, name="elastic.rng", world=world)
        checkpoint = dump_checkpoint(trainer, weights_only=False)  # every rank: it runs the user's hooks
        epoch, batch = _position(trainer)
        self.commits += 1
        if world.local_rank == 0 or self.in_process:
            checkpoint = snapshot_to_cpu(checkpoint)  # no tensor shared with the live model/optimizers
            checkpoint[COMMIT_KEY] = {
                "commit": self.commits, "run_id": self.run_id, "global_step": trainer.global_step,
                "epoch": epoch, "batch": batch, "world_size": trainer.world_size, "rng": rng,
            }
            if self.in_process:
                self._memory, self._commit_rank = checkpoint, world.rank
            else:
                _WRITER.submit(checkpoint, self.path)
        self._last_step = trainer.global_step
        log.debug("hvd_trainer elastic: commit %d at global step %d", self.commits, trainer.global_step)
        if self.in_process and comm.reform_due():
            raise comm.HostsUpdatedInterrupt(skip_sync=False)

    def commit_at_train_start(self, trainer: pl.Trainer) -> None:
        """In-process recovery: the state training starts from is the first commit, so a peer's
        failure before the first step commit still returns every survivor to one state."""
        if self.in_process and self._memory is None:
            self.commit(trainer)

    def maybe_commit_step(self, trainer: pl.Trainer) -> None:
        """Commit after every ``commit_every_n_steps``-th optimizer step, except after an epoch's
        last batch: the epoch-end commit follows (after validation). A fit resumed from the last
        batch's commit starts its next epoch with counters Lightning's loops do not see as
        started (``epoch_progress``), so a mid-epoch commit of that epoch would resume it from
        its first batch."""
        step = trainer.global_step
        if self.mid_epoch and step > 0 and step % self.every == 0 and step != self._last_step \
                and _position(trainer)[1] > 0:
            self.commit(trainer)

    def flush(self) -> None:
        """Wait until the last commit is on disk (raises :class:`PersistError` if a write failed)."""
        _WRITER.flush()

    def finish(self) -> None:
        """After a normal end of ``fit``: wait for the last write; drop an automatic directory's
        commit; with in-process recovery, let a restarted worker still waiting to join end (0)."""
        comm.finish_job()
        self.flush()
        if not self.automatic:
            return
        world = self.world
        comm.barrier(world=world)
        if world.local_rank == 0:
            discard(self.path)  # and a write a kill interrupted
            with contextlib.suppress(OSError):  # not empty: another fit's commit is still there
                self.path.parent.rmdir()


def _position(trainer: pl.Trainer) -> tuple[int, int]:
    """``(epoch, batches of it trained)``; a finished epoch counts as ``(epoch + 1, 0)``.

    Read from the loop counters at a commit (``on_train_batch_end``, ``on_validation_end``,
    ``on_train_epoch_end``): ``current_epoch`` is the running epoch there and
    ``batch_progress.current.processed`` the batches whose training step finished.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    progress = epoch_loop.batch_progress
    done = progress.current.processed
    if done >= trainer.num_training_batches or progress.is_last_batch:
        return trainer.current_epoch + 1, 0
    return trainer.current_epoch, done


def _continue_epoch_at(trainer: pl.Trainer, start: int) -> None:
    """The resumed epoch continues at batch ``start`` (its rest was dealt over another number of
    ranks, see :mod:`hvd_trainer.elastic.resumable_loader`): move the restored batch counters of
    the epoch there, keeping their differences (what the loop reads to know where it stopped)."""
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = start - current.processed
    current.ready += shift
    current.started += shift
    current.processed += shift
    current.completed += shift


class _ElasticCommit(pl.Callback):
    """Commits at optimizer-step multiples and epoch ends; clean-up after a normal ``fit``."""

    def __init__(self, elastic: ElasticFit) -> None:
        self.elastic = elastic

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.elastic.commit_at_train_start(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.elastic.maybe_commit_step(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.elastic.commit(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.elastic.finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """An exception of the user's code (not a peer's failure) tells hvdrun not to restart; a
        failed ``fit`` still leaves its last commit on disk before the error propagates."""
        if isinstance(exception, Exception):
            record_user_error(exception, rank=self.elastic.world.rank)
        try:
            self.elastic.flush()
        except PersistError as error:  # never hide the fit's own error behind the write's
            log.error("hvd_trainer elastic: %s", error)


def align_joiner_callbacks(trainer: pl.Trainer, *, survivor: bool, world: comm.World) -> None:
    """Give a restarted worker that joins a running ``fit`` the setup-once state the survivors'
    callbacks hold, so that both run the same collectives in the callbacks' ``setup`` hooks.

    Every rank calls it when in-process recovery runs ``fit``, before Lightning calls the
    callbacks' ``setup`` (one allgather of who is a survivor). A survivor runs ``setup`` again
    after a re-form; a callback that does its work once per job skips it there: Lightning's
    ``SaveConfigCallback`` (``LightningCLI``) keeps ``already_saved`` and returns at once, while a
    fresh process would check the file, save and broadcast. On a joiner (this rank is fresh, some
    rank is a survivor) every callback with an ``already_saved`` flag gets ``True``: the job's
    first ``fit`` saved the config already.

    Args:
        survivor: this rank ran the interrupted ``fit`` in this process.
    """
    flags = comm.allgather_object(survivor, name="elastic.lightning.survivors", world=world)
    if survivor or not any(flags):
        return
    for callback in trainer.callbacks:
        if isinstance(getattr(callback, "already_saved", None), bool):
            callback.already_saved = True


class InProcessFitLauncher:
    """The strategy's Lightning launcher (``strategy.launcher``) when hvdrun formed the job for
    in-process recovery: it runs ``fit`` in this process and, when a peer's failure (or a
    restarted worker waiting at a commit) interrupts it, re-forms the world with
    :func:`hvd_trainer.comm.recover` and runs ``fit`` again, which resumes from the newest commit
    in memory (see the module docstring). Anything else (a user error, a fit the launcher stopped
    with SIGTERM, ``validate``/``test``/``predict``, a fit without elastic mode) propagates as
    without it.

    Args:
        strategy: the :class:`~hvd_trainer.strategy.HorovodStrategy`; it provides ``elastic``
            (whether fit is elastic), ``elastic_fit`` (the running :class:`ElasticFit`) and
            ``follow_world(world)`` (adopt the re-formed world).
    """

    is_interactive_compatible = True

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None,
               **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` (Lightning's ``_fit_impl`` and the like), run again in this
        process after each recovered failure (Lightning's launcher interface).

        Raises:
            Exception: what ``function`` raised when it cannot be recovered in process; what
                :func:`hvd_trainer.comm.recover` raises (e.g. ``RankFailedError``: fewer than
                ``--min-np`` workers) when re-forming the world fails.
        """
        while True:
            try:
                return function(*args, **kwargs)
            except Exception as exc:
                if trainer is None or not self._recoverable(trainer, exc):
                    raise
                self._recover(trainer, exc)

    def kill(self, signum: int) -> None:
        """Nothing to kill: hvdrun started the processes (Lightning's launcher interface)."""

    def _recoverable(self, trainer: pl.Trainer, exc: BaseException) -> bool:
        # With in-process recovery the launcher's SIGTERM means the job is ending (torchrun sends
        # it once a worker exited: a user error, or a failure nothing recovered): the error it
        # raises (a peer is gone, lightning/signals.py) ends this rank too, instead of a re-formed
        # world training on until the launcher's SIGKILL.
        return (trainer.state.fn == TrainerFn.FITTING and bool(self.strategy.elastic)
                and comm.in_process_recovery() and is_peer_failure(exc) and not trainer.received_sigterm)

    def _recover(self, trainer: pl.Trainer, exc: BaseException) -> None:
        started = time.monotonic()
        old = comm.get_world().size if comm.is_initialized() else -1
        teardown_failed_run(trainer)
        world = comm.recover()
        self.strategy.follow_world(world)
        elastic = self.strategy.elastic_fit
        if elastic is not None:
            elastic.recovering = True
        trainer.state.status = TrainerStatus.RUNNING  # what Trainer.fit sets before its run
        trainer.training = True
        trainer.should_stop = False
        why = ("a worker joined" if isinstance(exc, comm.HostsUpdatedInterrupt)
               else f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
        if comm.first_survivor():  # rank 0 may be the worker that just joined
            log.warning("hvd_trainer elastic: world re-formed in process (%s): %d -> %d ranks in %.2f s; "
                        "fit continues from the newest commit", why, old, world.size,
                        time.monotonic() - started)

"""Elastic mode of ``Trainer(strategy="horovod")``: commit during ``fit``, resume after a restart.

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
   continues at the next batch and no sample is seen twice or skipped. For a loader that
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

Directory: ``elastic_checkpoint_dir`` if given (kept after the job); otherwise
``<tmp>/hvd_trainer_elastic/<TORCHELASTIC_RUN_ID>`` (what ``hvdrun`` gives: a fresh run id per
job; the rule of :func:`hvd_trainer.elastic.default_checkpoint_dir`), or
``<trainer.default_root_dir>/hvd_elastic`` when torchrun gave no unique run id (static
rendezvous). Automatic directories lose their commit file when ``fit`` ends normally.

Environment (set by torchrun, read through :func:`hvd_trainer.comm.base.launch_env.torchelastic_env`):
``TORCHELASTIC_MAX_RESTARTS`` (elastic mode is on by default when > 0),
``TORCHELASTIC_RESTART_COUNT`` (the attempt), ``TORCHELASTIC_RUN_ID`` (the default directory
and a guard against foreign commits).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn

import hvd_trainer.comm as comm
from hvd_trainer.checkpoint import load_checkpoint
from hvd_trainer.comm.base.launch_env import torchelastic_env
from hvd_trainer.elastic.persist import BackgroundWriter, PersistError, snapshot_to_cpu
from hvd_trainer.elastic.resumable_loader import ResumableDataLoader, ResumableSampler, make_resumable
from hvd_trainer.elastic.rng_state import capture_rng_states, restore_rng_states
from hvd_trainer.elastic.run import default_checkpoint_dir
from hvd_trainer.elastic.user_error import record_user_error
from hvd_trainer.lightning._compat import (
    dump_checkpoint,
    has_loaded_checkpoint,
    restore_modules_and_callbacks,
)

__all__ = ["ElasticFitConfig", "ElasticFit", "COMMIT_KEY"]

log = logging.getLogger(__name__)

COMMIT_KEY = "hvd_trainer_elastic"
"""Checkpoint key of the commit's metadata: ``commit``, ``run_id``, ``global_step``, ``epoch``,
``batch`` (batches of ``epoch`` done), ``world_size``, ``rng`` (every rank's RNG states, a list
indexed by global rank; see :mod:`hvd_trainer.elastic.rng_state`; plus ``sampler``: the
:attr:`~hvd_trainer.elastic.resumable_loader.ResumableSampler.epoch_rng` of a random training sampler)."""

_WRITER = BackgroundWriter()
"""Writes every elastic fit's commits of this process (so a later fit can wait for an earlier one's)."""

_FIT_CALLS = itertools.count()  # k in lightning_fit<k>.ckpt: the same k in every attempt


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
        self.path = directory / f"lightning_fit{next(_FIT_CALLS)}.ckpt"
        self.every = config.commit_every_n_steps
        self.mid_epoch = self.every > 0
        """False once the training loader turned out not to be resumable mid-epoch."""
        self.commits = 0
        self._last_step = -1
        self._loaded: dict[str, Any] | None = None
        self._rng: dict[str, Any] | None = None
        """This rank's RNG states of the resumed commit, until restored."""
        self._rng_before_loader = False
        """Restore them before the training iterator exists (epoch-boundary commit)."""
        self._sampler: ResumableSampler | None = None
        """The resumable training loader's sampler (its epoch's random-sampler states are committed)."""
        if max_restarts == 0:
            rank_zero_warn(
                f"HorovodStrategy(elastic=True) but torchrun will not restart workers "
                f"(TORCHELASTIC_MAX_RESTARTS={max_restarts}): commits are written to {self.path} "
                "but only a restarted attempt resumes from them. HINT: launch with "
                "hvdrun --min-np/--max-np or --max-restarts N."
            )

    # -- start of fit ----------------------------------------------------------------------
    def start(self, trainer: pl.Trainer) -> None:
        """Install the commit callback; in a restarted attempt restore the newest commit.

        Call at the start of ``strategy.setup`` (before the model is moved or wrapped).
        """
        trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, _ElasticCommit)]
        trainer.callbacks.append(_ElasticCommit(self))
        _WRITER.flush()  # an earlier fit of this process that raised may still be writing its commit
        world = self.world
        if self.attempt == 0:
            if world.local_rank == 0:
                self.path.unlink(missing_ok=True)  # an earlier job's commit is not ours
            comm.barrier(world=world)
            return
        if trainer.ckpt_path is not None or has_loaded_checkpoint(trainer):
            rank_zero_info(f"hvd_trainer elastic: fit(ckpt_path={trainer.ckpt_path!r}) given; "
                           "not resuming from the elastic commit.")
            return
        self._loaded = self._newest_commit(world)
        if self._loaded is None:
            rank_zero_info(f"hvd_trainer elastic: attempt {self.attempt}, no commit at {self.path}; "
                           "training from the start.")
            return
        meta = self._loaded[COMMIT_KEY]
        self.commits = int(meta["commit"])
        restore_modules_and_callbacks(trainer, self.path)  # loads via take_loaded()
        self._take_rng(meta, world)
        rank_zero_info(
            f"hvd_trainer elastic: attempt {self.attempt} resumed from {self.path} (commit "
            f"{meta['commit']}, global step {meta['global_step']}, epoch {meta['epoch']}, "
            f"batch {meta['batch']} of that epoch)"
        )

    def _take_rng(self, meta: dict[str, Any], world: comm.World) -> None:
        states = meta.get("rng")
        if states is None:
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
        """The commit read by :meth:`start` if ``path`` is its file (once), else ``None``."""
        if self._loaded is None or Path(path) != self.path:
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
        resumable, reason = make_resumable(dataloader, lambda: _position(trainer))
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
        :meth:`flush` waits for the file.

        Raises:
            PersistError: the previous background write failed.
        """
        world = self.world
        mine = capture_rng_states()
        mine["sampler"] = None if self._sampler is None else self._sampler.epoch_rng
        rng = comm.allgather_object(mine, name="elastic.rng", world=world)
        checkpoint = dump_checkpoint(trainer, weights_only=False)  # every rank: it runs the user's hooks
        epoch, batch = _position(trainer)
        self.commits += 1
        if world.local_rank == 0:
            checkpoint = snapshot_to_cpu(checkpoint)  # no tensor shared with the live model/optimizers
            checkpoint[COMMIT_KEY] = {
                "commit": self.commits, "run_id": self.run_id, "global_step": trainer.global_step,
                "epoch": epoch, "batch": batch, "world_size": trainer.world_size, "rng": rng,
            }
            _WRITER.submit(checkpoint, self.path)
        self._last_step = trainer.global_step
        log.debug("hvd_trainer elastic: commit %d at global step %d", self.commits, trainer.global_step)

    def maybe_commit_step(self, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        if self.mid_epoch and step > 0 and step % self.every == 0 and step != self._last_step:
            self.commit(trainer)

    def flush(self) -> None:
        """Wait until the last commit is on disk (raises :class:`PersistError` if a write failed)."""
        _WRITER.flush()

    def finish(self) -> None:
        """After a normal end of ``fit``: wait for the last write; drop an automatic directory's commit."""
        self.flush()
        if not self.automatic:
            return
        world = self.world
        comm.barrier(world=world)
        if world.local_rank == 0:
            self.path.unlink(missing_ok=True)
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


class _ElasticCommit(pl.Callback):
    """Commits at optimizer-step multiples and epoch ends; clean-up after a normal ``fit``."""

    def __init__(self, elastic: ElasticFit) -> None:
        self.elastic = elastic

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

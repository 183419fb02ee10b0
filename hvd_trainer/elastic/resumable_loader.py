"""A training DataLoader that Lightning can resume mid-epoch: no sample seen twice or skipped.

Lightning restarts an epoch's loader from its first batch unless the loader has
``state_dict``/``load_state_dict`` (``_Stateful``); then it stores the loader's state in every
checkpoint (``loops.fit_loop.state_dict.combined_loader``) and hands it back before the first
``iter()`` of a resumed fit. :class:`ResumableDataLoader` is such a loader: its state is
``(epoch, batches done in that epoch)``, and on load its :class:`ResumableSampler` skips the
first ``batches * batch_size`` indices of that epoch's order on this rank.

Why skipping indices is exact: the wrapped sampler (``DistributedSampler`` or
``SequentialSampler``) gives the same order on every attempt for the same epoch (its seed is
fixed and ``set_epoch`` picks the permutation) and ``BatchSampler`` cuts that order into
consecutive batches, so the batches after the skip are those the uninterrupted run drew.
A random sampler (``RandomSampler``, ``WeightedRandomSampler``, ``SubsetRandomSampler``) draws
its epoch's order from torch's global generator or its own ``generator`` when the epoch's
iteration starts; :class:`ResumableSampler` records those generator states then
(:attr:`ResumableSampler.epoch_rng`, per rank), and :meth:`ResumableSampler.replay` sets them
again while the resumed epoch's order is drawn, so the same order comes out.

The position is read from the Trainer's loop counters (``position``), not counted in
``__iter__``: Lightning may fetch a batch ahead of the training step (it prefetches from loaders
without a length), so the iterator's count is not the trained count.

Another world size (an elastic job that lost or regained ranks, in process or after a restart):
a ``DistributedSampler`` deals its epoch's order to the ranks round-robin, so the samples every
rank trained after ``b`` batches of ``B`` are exactly the first ``b * B * W`` of the epoch's order
(the *offset*, kept in the state). The resumed epoch deals the rest of that order over the new
world the same way (padded or cut as ``DistributedSampler`` pads or cuts), so no sample of the
epoch is skipped or trained twice. The new world's ranks then have another number of batches
left than the saved batch index implies; the epoch keeps its full length in batches (Lightning's
``num_training_batches``) and continues at the index from which the remaining batches end it
(the loader's ``on_resume`` moves Lightning's batch counters there).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

__all__ = ["ResumableSampler", "ResumableDataLoader", "ResumeStateError", "make_resumable"]

Position = Callable[[], tuple[int, int]]
"""Returns ``(epoch, batches of that epoch already trained)``; an exhausted epoch is
reported as ``(epoch + 1, 0)``."""

# samplers whose order depends only on (seed, epoch, rank, world size): a skip is exact
_REPRODUCIBLE = (DistributedSampler, SequentialSampler)
# samplers whose order depends only on torch's global generator and their own ``generator`` at the
# start of the epoch's iteration: a skip is exact once those states are set again
_SEEDED = (RandomSampler, WeightedRandomSampler, SubsetRandomSampler)
_DATALOADER_ARGS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
    "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order",
)


class ResumeStateError(ValueError):
    """A loader state that does not fit this loader (another dataset or batch size)."""


class ResumableSampler(Sampler[int]):
    """Wrap a reproducible ``sampler``; the next iteration may start after ``skip`` indices.

    ``len()`` stays the full epoch length (Lightning counts the resumed epoch's batches from
    the restored batch index, not from zero). :meth:`set_epoch` with a *different* epoch drops
    a pending skip and replay; with the same epoch it keeps them (Lightning calls it again on
    resume).

    Args:
        sampler: the per-rank index sampler, e.g. Lightning's ``DistributedSampler`` or a
            ``RandomSampler``.
    """

    def __init__(self, sampler: Sampler[int]) -> None:
        self.sampler = sampler
        self.epoch = int(getattr(sampler, "epoch", 0))
        self.skip = 0
        """Indices the next iteration drops (consumed once, by the next ``iter()``)."""
        self.epoch_rng: dict[str, torch.Tensor | None] | None = None
        """For a random sampler: ``{"torch", "generator"}`` states (``uint8`` tensors; ``generator``
        None without one) its current iteration drew its order from; else None."""
        self._replay: dict[str, torch.Tensor | None] | None = None
        self._deal_from: int | None = None
        """Offset into the epoch's global order the next iteration deals the rest from."""

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.skip = 0
            self._replay = None
            self._deal_from = None
        self.epoch = epoch
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]

    def resume_at(self, epoch: int, skip: int) -> None:
        """Make the next iteration epoch ``epoch``'s order without its first ``skip`` indices
        (a pending :meth:`replay` is kept)."""
        replay = self._replay
        self.set_epoch(epoch)
        self.skip, self._replay, self._deal_from = skip, replay, None

    def deal_from(self, epoch: int, offset: int) -> int:
        """Make the next iteration this rank's share of epoch ``epoch``'s samples that follow the
        first ``offset`` of the epoch's global order (those the ranks trained, in any world):
        the rest dealt round-robin over the wrapped ``DistributedSampler``'s ``num_replicas``,
        padded or cut as it pads or cuts. ``offset`` 0 gives exactly the wrapped sampler's order.

        Returns:
            How many indices this rank draws in that iteration.

        Raises:
            TypeError: the wrapped sampler is not a ``DistributedSampler``.
            ValueError: ``offset`` is negative.
        """
        if not isinstance(self.sampler, DistributedSampler):
            raise TypeError(f"deal_from needs a DistributedSampler, this one wraps a "
                            f"{type(self.sampler).__name__}.")
        if offset < 0:
            raise ValueError(f"offset={offset} must be >= 0 (samples of the epoch's order).")
        self.set_epoch(epoch)
        self.skip, self._replay, self._deal_from = 0, None, offset
        return len(_dealt(self.sampler, offset))

    def replay(self, epoch_rng: dict[str, torch.Tensor | None] | None) -> None:
        """Make the next iteration draw its order from ``epoch_rng`` (an :attr:`epoch_rng` of the
        epoch being resumed): the sampler's own generator is set to it, and torch's global
        generator only while the order is drawn (it is set back after). No-op for ``None`` or a
        sampler that draws nothing."""
        self._replay = epoch_rng if isinstance(self.sampler, _SEEDED) else None

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        replay, self._replay = self._replay, None
        offset, self._deal_from = self._deal_from, None
        if offset is not None:
            return iter(_dealt(self.sampler, offset))  # type: ignore[arg-type]
        if not isinstance(self.sampler, _SEEDED):
            return itertools.islice(iter(self.sampler), skip, None)
        # a random sampler draws from these generators at its first index, never later
        generator: torch.Generator | None = getattr(self.sampler, "generator", None)
        if replay is None:
            self.epoch_rng = {"torch": torch.get_rng_state(),
                              "generator": None if generator is None else generator.get_state()}
            return itertools.islice(iter(self.sampler), skip, None)
        self.epoch_rng = replay
        now = torch.get_rng_state()  # the resumed run's own state (restored by the elastic fit)
        torch.set_rng_state(replay["torch"])
        if generator is not None and replay["generator"] is not None:
            generator.set_state(replay["generator"])
        indices = iter(self.sampler)
        first = list(itertools.islice(indices, 1))  # the order is drawn now
        torch.set_rng_state(now)
        return itertools.islice(itertools.chain(first, indices), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableSampler` with Lightning's ``_Stateful`` interface.

    Build it with :func:`make_resumable`. ``state_dict()`` is ``{"epoch", "batches",
    "batch_size", "num_replicas", "length", "offset"}`` (``batches``: batches of ``epoch``
    trained on each rank, Lightning's batch index; ``offset``: samples of the epoch's global
    order trained by all ranks together, see the module docstring); ``load_state_dict`` makes
    the next ``iter()`` continue that epoch where it stopped.

    A state saved with another world size (an elastic job that shrank or grew) deals the rest
    of the epoch over this loader's ranks; the epoch then continues at another batch index,
    which ``load_state_dict`` passes to ``on_resume`` (a state without ``offset``, written
    before it existed, counts as ``batches * batch_size * num_replicas``).

    Args:
        position: returns ``(epoch, batches of it trained)`` (see :data:`Position`).
        on_resume: called by ``load_state_dict`` with the batch index (batches, 0-based count
            of batches already done) at which the resumed epoch continues, when it is not the
            saved one (another world size): the caller moves its loop counters there.

    Raises:
        ResumeStateError: (``load_state_dict``) the state was saved for a dataset of another
            length or another batch size; or with another world size and no ``on_resume``.
    """

    def __init__(self, *args: Any, position: Position, on_resume: Callable[[int], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = position
        self.on_resume = on_resume
        self._segment = (-1, 0, 0)
        """``(epoch, offset, batch)``: that epoch resumed at ``batch`` after ``offset`` samples."""

    def state_dict(self) -> dict[str, Any]:
        epoch, batches = self.position()
        return {"epoch": epoch, "batches": batches, "batch_size": self.batch_size,
                "num_replicas": _num_replicas(self.sampler), "length": len(self.dataset),  # type: ignore[arg-type]
                "offset": self._offset(epoch, batches)}

    def _offset(self, epoch: int, batches: int) -> int:
        """Samples of ``epoch``'s order trained by every rank together after ``batches``."""
        seg_epoch, offset, start = self._segment
        if seg_epoch != epoch:
            offset, start = 0, 0
        return offset + (batches - start) * int(self.batch_size or 1) * _num_replicas(self.sampler)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, now in (("length", len(self.dataset)), ("batch_size", self.batch_size)):  # type: ignore[arg-type]
            if state[key] != now:
                raise ResumeStateError(
                    f"the training loader state was saved with {key}={state[key]!r}, this loader has "
                    f"{key}={now!r}. HINT: resume with the same dataset and batch size, or delete the "
                    "elastic checkpoint to start over."
                )
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler)
        epoch, batches, size = int(state["epoch"]), int(state["batches"]), int(state["batch_size"])
        replicas = _num_replicas(sampler)
        offset = int(state.get("offset", batches * size * int(state["num_replicas"])))
        if offset == batches * size * replicas or not isinstance(sampler.sampler, DistributedSampler):
            sampler.resume_at(epoch, batches * size)  # this world's own prefix: skip this rank's part
            self._segment = (epoch, offset, batches)
            return
        count = sampler.deal_from(epoch, offset)
        left = count // size if self.drop_last else math.ceil(count / size)
        start = len(self) - left
        self._segment = (epoch, offset, start)
        if start == batches:
            return
        if self.on_resume is None:
            raise ResumeStateError(
                f"the training loader was saved on {state['num_replicas']} ranks and resumes on "
                f"{replicas}: epoch {epoch} continues at batch {start}, not {batches}, and no "
                "on_resume was given to move the loop there. HINT: make_resumable(..., on_resume=...)."
            )
        self.on_resume(start)


def _dealt(sampler: DistributedSampler, offset: int) -> list[int]:
    """``sampler``'s rank's share of its epoch's order after the first ``offset`` samples: the
    rest dealt round-robin over ``num_replicas``, cut (``drop_last``) or padded with the
    order's first samples to a multiple of it, as ``DistributedSampler`` does for the whole."""
    whole = DistributedSampler(sampler.dataset, num_replicas=1, rank=0, shuffle=sampler.shuffle,
                               seed=sampler.seed)  # the epoch's global order, unpadded
    whole.set_epoch(sampler.epoch)
    order = list(whole)
    rest = order[min(offset, len(order)):]
    replicas = sampler.num_replicas
    if sampler.drop_last:
        rest = rest[:len(rest) - len(rest) % replicas]
    elif rest and len(rest) % replicas:
        pad = replicas - len(rest) % replicas
        rest += (order * math.ceil(pad / len(order)))[:pad]
    return rest[sampler.rank::replicas]


def _num_replicas(sampler: Any) -> int:
    return int(getattr(getattr(sampler, "sampler", None), "num_replicas", 1))


def make_resumable(loader: object, position: Position,
                   on_resume: Callable[[int], None] | None = None) -> tuple[object, str | None]:
    """Return ``(resumable copy of loader, None)``, or ``(loader, why not)`` when a skip would
    not be exact.

    Supported: a plain ``torch.utils.data.DataLoader`` over a map-style dataset with automatic
    batching (``batch_size``, no custom ``batch_sampler``) and a ``DistributedSampler`` or
    ``SequentialSampler`` (what Lightning injects by default), or a ``RandomSampler``,
    ``WeightedRandomSampler`` or ``SubsetRandomSampler`` (exact when the resume also calls
    :meth:`ResumableSampler.replay` with the rank's :attr:`ResumableSampler.epoch_rng`).
    Every other argument of the
    loader (workers, collate function, pinning, generator) is passed on unchanged.
    ``position`` and ``on_resume``: see :class:`ResumableDataLoader`.
    """
    reason = _unsupported(loader)
    if reason is not None:
        return loader, reason
    assert isinstance(loader, DataLoader)
    kwargs = {name: getattr(loader, name) for name in _DATALOADER_ARGS if hasattr(loader, name)}
    resumable = ResumableDataLoader(
        loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last,
        sampler=ResumableSampler(loader.sampler), position=position,
        on_resume=on_resume, **kwargs,
    )
    return resumable, None


def _unsupported(loader: object) -> str | None:
    if isinstance(loader, ResumableDataLoader):
        return "it is already resumable"
    if type(loader) is not DataLoader:
        return f"it is a {type(loader).__name__}, not a plain torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return "its dataset is an IterableDataset (no index to skip to)"
    if type(loader.batch_sampler) is not BatchSampler:
        return f"it has a custom batch sampler ({type(loader.batch_sampler).__name__})"
    if type(loader.sampler) not in _REPRODUCIBLE + _SEEDED:
        return (f"its sampler {type(loader.sampler).__name__} may not give the same order again "
                "(use_distributed_sampler=True gives a reproducible DistributedSampler)")
    return None

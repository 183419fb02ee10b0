"""A distributed sampler that resumes mid-epoch: no sample is seen twice or skipped.

Why one integer is enough: each epoch's order (a seeded permutation) is dealt round-robin
over the ranks, so after ``k`` steps of ``b`` samples on ``n`` ranks the samples consumed are
exactly the first ``k * b * n`` of the order, whatever ``n`` was. The sampler records that
count (``processed``, Horovod's ``processed_num``); after a restart the rest of the order is
dealt to the new world. With an unchanged world the resumed steps draw exactly the batches the
uninterrupted run would.

Horovod's semantics, kept: :meth:`ElasticSampler.record_batch` adds ``batch_size * size`` to the
count (its ``batch_idx`` is not used); the indices an iteration yields are fixed when the
position is (re)set (:meth:`~ElasticSampler.set_epoch`, ``load_state_dict`` through
``restore()``/``sync()``), so iterating again without one of them repeats the same indices.
One difference: ``set_epoch`` with the *current* epoch keeps the position (Horovod clears it), so
a resumed loop that calls ``set_epoch(state.epoch)`` at the top does not lose the committed
progress.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from hvd_trainer.comm import World, get_world, is_initialized

__all__ = ["ElasticSampler"]


class ElasticSampler(Sampler[int]):
    """Shard ``dataset`` over the ranks and remember how far the epoch got.

    Call :meth:`record_batch` after each step and include the sampler in the elastic state
    (``TorchState(model, optimizer, sampler=sampler)``; it has ``state_dict``/``load_state_dict``).
    :meth:`set_epoch` with a *new* epoch starts it from the beginning; with the current epoch
    it keeps the position (so a resumed loop may call it again).

    Args:
        dataset: anything with ``len()``.
        shuffle: a new permutation per epoch from ``seed + epoch``; else ``0..len-1``.
        seed: base seed of the permutation, identical on every rank.
        drop_last: drop the tail that does not fill every rank; otherwise pad by repeating
            the first remaining indices (like ``DistributedSampler``).
        world: the world to shard over. Default: the current one, looked up at every use (so
            after in-process recovery the rest of the epoch is dealt over the new world; before
            ``hvd_trainer.init()`` the sampler acts as a world of one).

    Raises:
        ValueError: an empty dataset.
    """

    def __init__(
        self, dataset: Sized, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
        world: World | None = None,
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("ElasticSampler got an empty dataset (len 0). HINT: check the data path.")
        self.length = len(dataset)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.processed = 0
        """Samples of this epoch consumed by all ranks together (a prefix of the order)."""
        self._base = 0
        """``processed`` when the position was last set: where the next iteration starts."""
        self.world = world

    @property
    def processed_num(self) -> int:
        """Horovod's name of :attr:`processed` (samples of this epoch done by all ranks together)."""
        return self.processed

    @processed_num.setter
    def processed_num(self, value: int) -> None:
        self.processed = int(value)

    @property
    def num_replicas(self) -> int:
        """Ranks the epoch is dealt over (Horovod's attribute; the world's size)."""
        return self._world()[1]

    @property
    def rank(self) -> int:
        """This rank in :attr:`world` (Horovod's attribute)."""
        return self._world()[0]

    @property
    def processed_indices(self) -> set[int]:
        """Dataset indices of this epoch done by all ranks (the first :attr:`processed` of the order)."""
        return set(self._order()[: self.processed])

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's dataset indices of batch ``batch_idx`` of the current iteration."""
        mine = self._mine()
        return mine[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def _world(self) -> tuple[int, int]:
        """``(rank, size)`` of :attr:`world`, else of the current world (one before ``init()``)."""
        if self.world is None:
            if not is_initialized():
                return 0, 1
            current = get_world()
            return current.rank, current.size
        return self.world.rank, self.world.size

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=gen).tolist()

    def _remaining(self, replicas: int) -> list[int]:
        rest = self._order()[self._base:]
        tail = len(rest) % replicas
        if tail and self.drop_last:
            rest = rest[: len(rest) - tail]
        elif tail:
            rest = rest + rest[: replicas - tail]
        return rest

    def _mine(self) -> list[int]:
        rank, replicas = self._world()
        return self._remaining(replicas)[rank::replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self._mine())

    def __len__(self) -> int:
        _, replicas = self._world()
        return len(self._remaining(replicas)) // replicas

    def set_epoch(self, epoch: int) -> None:
        """Switch to ``epoch`` and deal what is left of it; a new epoch restarts at sample 0.

        The next iteration yields this rank's share of the samples not yet :attr:`processed`.
        """
        if epoch != self.epoch:
            self.epoch = epoch
            self.processed = 0
        self._base = self.processed

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one more batch of ``batch_size`` per rank as done on every rank (as Horovod does).

        Adds ``batch_size * num_replicas`` to :attr:`processed` (at most the dataset's length);
        call it once per trained batch. ``batch_idx`` is accepted for Horovod's signature.
        """
        del batch_idx
        self.processed = min(self.length, self.processed + batch_size * self.num_replicas)

    def record_indices(self, indices: list[int]) -> None:
        """Count this rank's batch ``indices`` as done on every rank (``len(indices) * num_replicas``)."""
        self.processed = min(self.length, self.processed + len(indices) * self.num_replicas)

    def state_dict(self) -> dict[str, Any]:
        """``epoch``, ``processed`` (also as Horovod's ``processed_num``), ``seed``, ``shuffle``,
        ``length``."""
        return {"epoch": self.epoch, "processed": self.processed, "processed_num": self.processed,
                "seed": self.seed, "shuffle": self.shuffle, "length": self.length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the position of ``state`` (also Horovod's ``{"epoch", "processed_num"}``) and deal the rest.

        Raises:
            ValueError: ``state`` is for a dataset of another length.
        """
        if "length" not in state:  # Horovod's sampler state: epoch and count only
            self.epoch, self.processed = int(state["epoch"]), int(state["processed_num"])
            self._base = self.processed
            return
        if state["length"] != self.length:
            raise ValueError(
                f"ElasticSampler state is for a dataset of {state['length']} samples, this one has "
                f"{self.length}. HINT: resume with the same dataset or start a fresh run directory."
            )
        self.epoch, self.processed = int(state["epoch"]), int(state["processed"])
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self._base = self.processed

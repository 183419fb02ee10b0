"""A distributed sampler that resumes mid-epoch: no sample is seen twice or skipped.

Why one integer is enough: each epoch's order (a seeded permutation) is dealt round-robin
over the ranks, so after ``k`` steps of ``b`` samples on ``n`` ranks the samples consumed are
exactly the first ``k * b * n`` of the order, whatever ``n`` was. The sampler records that
count (``processed``); after a restart the rest of the order is dealt to the new world. With
an unchanged world the resumed steps draw exactly the batches the uninterrupted run would.
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
    (it has ``state_dict``/``load_state_dict``). :meth:`set_epoch` with a *new* epoch starts
    it from the beginning; with the current epoch it keeps the position (so a resumed loop
    may call it again).

    Args:
        dataset: anything with ``len()``.
        shuffle: a new permutation per epoch from ``seed + epoch``; else ``0..len-1``.
        seed: base seed of the permutation, identical on every rank.
        drop_last: drop the tail that does not fill every rank; otherwise pad by repeating
            the first remaining indices (like ``DistributedSampler``).
        world: the world to shard over. Default: the initialised one, looked up at the first
            iteration and kept (before ``hvd_trainer.init()`` the sampler acts as a world of one).

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
        self._start = 0
        self._replicas = 1
        self.world = world

    def _world(self) -> tuple[int, int]:
        """``(rank, size)`` of :attr:`world`, resolved once (a world of one before ``init()``)."""
        if self.world is None:
            if not is_initialized():
                return 0, 1
            self.world = get_world()
        return self.world.rank, self.world.size

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=gen).tolist()

    def _remaining(self, replicas: int) -> list[int]:
        rest = self._order()[self.processed:]
        tail = len(rest) % replicas
        if tail and self.drop_last:
            rest = rest[: len(rest) - tail]
        elif tail:
            rest = rest + rest[: replicas - tail]
        return rest

    def __iter__(self) -> Iterator[int]:
        rank, replicas = self._world()
        self._start, self._replicas = self.processed, replicas
        return iter(self._remaining(replicas)[rank::replicas])

    def __len__(self) -> int:
        _, replicas = self._world()
        return len(self._remaining(replicas)) // replicas

    def set_epoch(self, epoch: int) -> None:
        """Switch to ``epoch``; a different epoch than the current one restarts at sample 0."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.processed = 0

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batches ``0..batch_idx`` of the current iteration (``batch_size`` per rank) done."""
        self.processed = min(self.length, self._start + (batch_idx + 1) * batch_size * self._replicas)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed": self.processed, "seed": self.seed,
                "shuffle": self.shuffle, "length": self.length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["length"] != self.length:
            raise ValueError(
                f"ElasticSampler state is for a dataset of {state['length']} samples, this one has "
                f"{self.length}. HINT: resume with the same dataset or start a fresh run directory."
            )
        self.epoch, self.processed = int(state["epoch"]), int(state["processed"])
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self._start = self.processed

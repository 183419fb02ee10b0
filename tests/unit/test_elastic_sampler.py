"""ElasticSampler shards over the world it is given (no global lookup), resolved once."""

from __future__ import annotations

import torch

import hvd_trainer
from hvd_trainer.comm.world import World
from hvd_trainer.elastic import ElasticSampler


def _world(rank: int, size: int) -> World:
    return World(rank=rank, size=size, local_rank=rank, local_size=size, cross_rank=0, cross_size=1,
                 device=torch.device("cpu"), backend="gloo")


def test_shards_over_the_given_world() -> None:
    assert not hvd_trainer.is_initialized()  # nothing global to read
    shards = [list(ElasticSampler(range(10), shuffle=False, world=_world(r, 3))) for r in range(3)]
    # 10 samples padded to 12 by repeating the first ones, dealt round-robin
    assert shards == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    assert len(ElasticSampler(range(10), shuffle=False, world=_world(0, 3))) == 4


def test_resume_on_a_given_world_continues_the_order() -> None:
    sampler = ElasticSampler(range(8), shuffle=True, seed=5, world=_world(1, 2))
    order = torch.randperm(8, generator=torch.Generator().manual_seed(5)).tolist()
    first = list(sampler)
    assert first == order[1::2]
    sampler.record_batch(0, 2)  # one batch of 2 per rank: 4 samples of the order consumed
    resumed = ElasticSampler(range(8), shuffle=True, seed=5, world=_world(1, 2))
    resumed.load_state_dict(sampler.state_dict())
    assert list(resumed) == order[5::2]


def test_without_a_world_before_init_is_a_world_of_one() -> None:
    sampler = ElasticSampler(range(4), shuffle=False)
    assert list(sampler) == [0, 1, 2, 3] and sampler.world is None  # not pinned before init

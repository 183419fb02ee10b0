"""ElasticSampler shards over the world it is given (no global lookup), resolved once."""

from __future__ import annotations

import torch

import hvd_trainer
from hvd_trainer.comm.world.world import World
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


def test_horovod_counting_and_dealing_on_one_rank() -> None:
    """Horovod's semantics: ``record_batch`` adds ``batch_size * size``; the deal is fixed at reset points."""
    sampler = ElasticSampler(range(8), shuffle=True, world=_world(0, 1))
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch_idx, _ in enumerate(torch.utils.data.DataLoader(range(8), batch_size=2, sampler=sampler)):
            sampler.record_batch(batch_idx, 2)
            assert sampler.processed_num == 2 * (batch_idx + 1)
    # no set_epoch: the same deal again (Horovod repeats it); the count stays at the full epoch
    again = [int(i) for i in sampler]
    assert sorted(again) == list(range(8)) and sampler.processed_num == 8
    sampler.set_epoch(2)
    assert sampler.processed_num == 0 and len(sampler) == 8
    sampler.record_batch(7, 2)  # batch_idx is not used: one more batch counted
    sampler.set_epoch(2)  # the current epoch keeps the count (Horovod would clear it) and re-deals
    assert sampler.processed_num == 2 and len(sampler) == 6
    assert list(sampler) == sampler._order()[2:]


def test_horovod_state_dict_round_trips() -> None:
    sampler = ElasticSampler(range(10), shuffle=False, world=_world(1, 2))
    sampler.load_state_dict({"epoch": 3, "processed_num": 4})  # what Horovod's sampler saves
    assert (sampler.epoch, sampler.processed_num, list(sampler)) == (3, 4, [5, 7, 9])
    assert sampler.state_dict()["processed_num"] == 4
    assert (sampler.rank, sampler.num_replicas) == (1, 2)
    sampler.record_indices([5, 7])  # this rank's 2 samples: 4 on both ranks
    assert sampler.processed_num == 8

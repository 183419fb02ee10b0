"""ResumableSampler / ResumableDataLoader: a resumed epoch continues exactly at the saved batch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    RandomSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from hvd_trainer.elastic.resumable_loader import (
    ResumableDataLoader,
    ResumableSampler,
    ResumeStateError,
    make_resumable,
)

N, BATCH = 22, 3  # 11 per rank: 4 batches, the last one partial


def _loader(rank: int, *, num_workers: int = 0, position=lambda: (0, 0), replicas: int = 2,
            on_resume=None, n: int = N, drop_last: bool = False) -> DataLoader:
    data = TensorDataset(torch.arange(n))
    sampler = DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=True, seed=5,
                                 drop_last=drop_last)
    loader, reason = make_resumable(DataLoader(data, batch_size=BATCH, sampler=sampler,
                                               num_workers=num_workers), position, on_resume)
    assert reason is None and isinstance(loader, ResumableDataLoader)
    return loader


def _epoch(loader: DataLoader, epoch: int) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)
    return [batch[0].tolist() for batch in loader]


def test_sampler_skips_once_and_keeps_full_length() -> None:
    inner = DistributedSampler(range(N), num_replicas=2, rank=1, shuffle=True, seed=5)
    sampler = ResumableSampler(inner)
    inner.set_epoch(2)
    full = list(inner)
    sampler.resume_at(2, 4)
    assert len(sampler) == len(full) == 11  # the epoch's length, not what is left
    assert list(sampler) == full[4:]
    assert list(sampler) == full  # one-shot: the next iteration is whole again
    sampler.resume_at(2, 4)
    sampler.set_epoch(2)  # Lightning sets the same epoch again on resume: keeps the skip
    assert list(sampler) == full[4:]
    sampler.resume_at(2, 4)
    sampler.set_epoch(3)  # a new epoch drops it
    inner.set_epoch(3)
    assert list(sampler) == list(inner) and sampler.skip == 0


@pytest.mark.parametrize("drop_last", [False, True])
def test_dealing_from_this_worlds_prefix_is_the_sampler_own_order(drop_last: bool) -> None:
    for replicas in (1, 2, 3, 4):
        for rank in range(replicas):
            inner = DistributedSampler(range(N), num_replicas=replicas, rank=rank, shuffle=True, seed=5,
                                       drop_last=drop_last)
            inner.set_epoch(3)
            full = list(inner)
            for done in range(len(full) // BATCH + 1):
                sampler = ResumableSampler(inner)
                assert sampler.deal_from(3, done * BATCH * replicas) == len(full) - done * BATCH
                assert list(sampler) == full[done * BATCH:], (replicas, rank, done)
    with pytest.raises(TypeError, match="RandomSampler"):
        ResumableSampler(RandomSampler(range(N))).deal_from(0, 3)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resumed_epoch_draws_the_remaining_batches_of_every_rank(num_workers: int) -> None:
    for done in range(5):  # 0..4 batches of epoch 1 already trained on each rank
        seen = []
        for rank in (0, 1):
            whole = _epoch(_loader(rank), 1)
            state = _loader(rank, position=lambda d=done: (1, d)).state_dict()
            assert state == {"epoch": 1, "batches": done, "batch_size": BATCH, "num_replicas": 2, "length": N,
                             "offset": done * BATCH * 2}
            fresh = _loader(rank, num_workers=num_workers)  # a restarted process
            fresh.load_state_dict(state)  # before the first iter(), as Lightning does
            rest = [batch[0].tolist() for batch in fresh]  # no set_epoch needed: the state has it
            assert rest == whole[done:], (rank, done)
            seen += [i for batch in whole[:done] + rest for i in batch]
        # DistributedSampler pads 22 to 22 (even): every sample exactly once over both ranks
        assert sorted(seen) == list(range(N)), done


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("before", "after"), [(2, 1), (2, 3), (1, 2), (3, 2)])
def test_another_world_size_deals_the_rest_of_the_epoch(before: int, after: int, drop_last: bool) -> None:
    """Resumed on another number of ranks, the epoch goes on with the samples no rank trained
    yet, dealt over the new ranks, and ends at the epoch's full batch count in the new world."""
    n = 24  # the first world's shards need no padding
    whole = [_epoch(_loader(r, replicas=before, n=n, drop_last=drop_last), 1) for r in range(before)]
    for done in range(len(whole[0])):  # batches trained before; the last one is still to come
        trained = [i for r in range(before) for batch in whole[r][:done] for i in batch]
        state = _loader(0, replicas=before, n=n, position=lambda d=done: (1, d)).state_dict()
        assert state["offset"] == len(trained) == done * BATCH * before
        rest = []
        for rank in range(after):
            starts: list[int] = []
            fresh = _loader(rank, replicas=after, n=n, drop_last=drop_last, on_resume=starts.append)
            fresh.load_state_dict(state)
            batches = [batch[0].tolist() for batch in fresh]
            start = starts[0] if starts else done
            assert start + len(batches) == len(fresh), (rank, start)  # the epoch ends on time
            rest += [i for batch in batches for i in batch]
            fresh.position = lambda s=start: (1, s + 1)  # a commit one batch later in the new world
            assert fresh.state_dict()["offset"] == len(trained) + BATCH * after
        left = n - len(trained)  # over `after` ranks: padded with repeats, or cut with drop_last
        seen = trained + rest
        if drop_last:
            assert len(seen) == len(set(seen)) == n - left % after, (done, before, after)
        else:
            assert set(seen) == set(range(n)) and len(seen) == n + (-left) % after, (done, before, after)


def test_resumed_share_is_padded_like_distributed_sampler() -> None:
    """22 samples, 6 trained, 16 left over 3 ranks: padded to 18 with the order's first samples."""
    state = _loader(0, position=lambda: (0, 1)).state_dict()
    shares = []
    for rank in range(3):
        loader = _loader(rank, replicas=3, on_resume=lambda start: None)
        loader.load_state_dict(state)
        shares.append([i for batch in loader for i in batch[0].tolist()])
    assert [len(s) for s in shares] == [6, 6, 6]
    trained = _epoch(_loader(0), 0)[0] + _epoch(_loader(1), 0)[0]
    seen = trained + [i for s in shares for i in s]
    order = list(DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=5))
    assert sorted(seen) == sorted([*range(N), *order[:2]])  # the epoch order's first two, again


def test_state_of_another_dataset_is_refused() -> None:
    state = _loader(0, position=lambda: (0, 1)).state_dict()
    with pytest.raises(ResumeStateError, match="length=22") as info:
        _loader(0).load_state_dict({**state, "length": 30})
    assert "HINT" in str(info.value)
    with pytest.raises(ResumeStateError, match="batch_size=8"):
        _loader(0).load_state_dict({**state, "batch_size": 8})
    # another world size whose rest of the epoch ends at another batch index: only with on_resume
    with pytest.raises(ResumeStateError, match="saved on 4 ranks and resumes on 2: epoch 0 continues "
                                               "at batch 2, not 1"):
        _loader(0).load_state_dict({**state, "num_replicas": 4, "offset": 12})


def test_loader_arguments_survive_and_unsupported_loaders_are_named() -> None:
    data = TensorDataset(torch.arange(8))
    gen = torch.Generator()

    def collate(batch: list) -> list:
        return batch

    plain = DataLoader(data, batch_size=2, drop_last=True, collate_fn=collate, generator=gen)
    copy, reason = make_resumable(plain, lambda: (0, 0))
    assert reason is None
    assert (copy.batch_size, copy.drop_last, copy.collate_fn, copy.generator) == (2, True, collate, gen)

    class MyLoader(DataLoader):
        pass

    class MySampler(RandomSampler):
        pass

    class Stream(IterableDataset):
        def __iter__(self):  # noqa: ANN204
            return iter(range(4))

    cases = {
        "MyLoader": MyLoader(data, batch_size=2),
        "IterableDataset": DataLoader(Stream(), batch_size=2),
        "MySampler": DataLoader(data, batch_size=2, sampler=MySampler(data)),
        "custom batch sampler": DataLoader(data, batch_sampler=[[0, 1], [2, 3]]),
    }
    for needle, loader in cases.items():
        same, reason = make_resumable(loader, lambda: (0, 0))
        assert same is loader and needle in reason, (needle, reason)


@pytest.mark.parametrize("make", [
    lambda: RandomSampler(range(N)),
    lambda: RandomSampler(range(N), generator=torch.Generator().manual_seed(5)),
    lambda: RandomSampler(range(N), replacement=True, num_samples=40),
    lambda: WeightedRandomSampler(torch.linspace(1.0, 3.0, N), N),
    lambda: SubsetRandomSampler(list(range(3, N))),
])
def test_random_sampler_replays_its_epoch_order(make) -> None:  # noqa: ANN001
    """The order a random sampler drew is drawn again from the recorded states, skip applied,
    without moving torch's global generator (the elastic fit restores that one itself)."""
    torch.manual_seed(0)
    sampler = ResumableSampler(make())
    order = list(sampler)
    recorded = sampler.epoch_rng
    assert recorded is not None and list(sampler) != order  # the next epoch draws another order
    resumed = ResumableSampler(make())
    torch.manual_seed(99)
    before = torch.get_rng_state()
    resumed.replay(recorded)
    resumed.resume_at(0, 5)
    assert list(resumed) == order[5:]
    assert torch.equal(torch.get_rng_state(), before)
    assert ResumableSampler(make()).epoch_rng is None  # records only when iterated

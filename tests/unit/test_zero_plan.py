"""The ZeRO shard plan (hvd_trainer/comm/zero/plan.py): a pure function, checked on closed-form
layouts and random ones against the documented balance bound and layout invariants."""

from __future__ import annotations

import random

import pytest

from hvd_trainer.comm.zero.plan import plan_shards


def test_two_equal_parameters_one_each() -> None:
    plan = plan_shards([[0, 1]], [10, 10], [4, 4], 2)
    assert sorted(plan.owner) == [0, 1] and plan.owned_bytes == (40, 40)
    shard = plan.buckets[0]
    assert shard.scatter and shard.chunk == 11  # 10 gradients + 1 used flag per rank
    assert shard.buffer_numel == 22 and shard.seg_start == (0, 11)
    assert shard.flag_offsets() == (10, 21)


def test_lone_large_parameter_is_allreduced_at_three_ranks() -> None:
    # N * chunk = 3 * 101 > 2 * 101: a reduce-scatter would send more than an allreduce.
    plan = plan_shards([[0]], [100], [4], 3)
    assert not plan.buckets[0].scatter and plan.buckets[0].buffer_numel == 101
    # at two ranks the traffic is equal, so it is reduce-scattered
    assert plan_shards([[0]], [100], [4], 2).buckets[0].scatter


def test_lone_buckets_go_to_the_lightest_rank() -> None:
    plan = plan_shards([[0], [1], [2]], [50, 30, 20], [4, 4, 4], 2)
    assert plan.owner == (0, 1, 1) and plan.owned_bytes == (200, 200)


def _random_layout(seed: int) -> tuple[list[list[int]], list[int]]:
    """1-40 parameters of mixed sizes in buckets of 1-6, in order."""
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    numels = [rng.choice([1, 7, 64, 300, 4096]) for _ in range(n)]
    buckets, i = [], 0
    while i < n:
        k = rng.randint(1, 6)
        buckets.append(list(range(i, min(n, i + k))))
        i += k
    return buckets, numels


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("size", [2, 3, 5])
def test_random_layouts_keep_the_bound_and_the_layout(seed: int, size: int) -> None:
    buckets, numels = _random_layout(seed)
    n = len(numels)
    plan = plan_shards(buckets, numels, [4] * n, size)
    # every parameter owned once; the documented bound on the spread of owned bytes
    assert sum(plan.owned_bytes) == 4 * sum(numels)
    assert max(plan.owned_bytes) - min(plan.owned_bytes) <= 4 * max(numels)
    assert plan == plan_shards(buckets, numels, [4] * n, size)  # deterministic
    for bucket, shard in zip(buckets, plan.buckets, strict=True):
        assert sorted(shard.params) == sorted(bucket)
        assert list(shard.owners) == sorted(shard.owners)  # laid out by owner
        offsets, flags = shard.offsets(), shard.flag_offsets()
        cells = set()
        for off, numel, flag in zip(offsets, shard.numels, flags, strict=True):
            cells |= set(range(off, off + numel)) | {flag}
        assert len(cells) == sum(shard.numels) + len(shard.numels)  # no overlap
        assert max(cells) < shard.buffer_numel
        for r in range(size):  # each rank's cells lie in its segment
            start, length = shard.seg_start[r], shard.seg_len[r]
            mine = [k for k, o in enumerate(shard.owners) if o == r]
            for k in mine:
                assert start <= offsets[k] and offsets[k] + shard.numels[k] <= start + length
                assert start <= flags[k] < start + length
        if shard.scatter:
            assert size * shard.chunk <= 2 * sum(shard.seg_len)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="size=0"):
        plan_shards([[0]], [1], [4], 0)
    with pytest.raises(ValueError, match="exactly once"):
        plan_shards([[0, 0]], [1, 1], [4, 4], 2)


# -- by elements (split=True) -------------------------------------------------------------------
def test_split_cuts_a_lone_parameter_into_equal_pieces() -> None:
    plan = plan_shards([[0]], [100], [4], 3, split=True)
    shard = plan.buckets[0]
    assert plan.owner == (-1,)  # cut between ranks
    assert sorted(plan.owned_bytes) == [128, 136, 136]  # ceil(100/3) = 34 elements, the last 32
    assert sorted(zip(shard.starts, shard.numels, strict=True)) == [(0, 34), (34, 34), (68, 32)]
    assert sorted(shard.owners) == [0, 1, 2] and shard.scatter


def test_split_matches_the_issues_mlp() -> None:
    # A 256x256 weight is 77 % of this MLP: whole parameters leave 0.77 of the state on one rank.
    numels = [64 * 256, 256, 256 * 256, 256, 256 * 10, 10]
    for size in (2, 3):
        whole = plan_shards([list(range(6))], numels, [4] * 6, size)
        cut = plan_shards([list(range(6))], numels, [4] * 6, size, split=True)
        total = 4 * sum(numels)
        assert max(whole.owned_bytes) / total > 0.77
        assert max(cut.owned_bytes) - min(cut.owned_bytes) <= 4 * (size - 1)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("size", [2, 3, 5])
def test_split_layouts_cover_every_element_once_and_balance(seed: int, size: int) -> None:
    buckets, numels = _random_layout(seed)
    n = len(numels)
    plan = plan_shards(buckets, numels, [4] * n, size, split=True)
    assert plan == plan_shards(buckets, numels, [4] * n, size, split=True)  # deterministic
    assert sum(plan.owned_bytes) == 4 * sum(numels)
    # within N-1 elements per bucket, and over the model within N-1 elements
    assert max(plan.owned_bytes) - min(plan.owned_bytes) <= 4 * (size - 1)
    covered: dict[int, list[tuple[int, int, int]]] = {}
    for shard in plan.buckets:
        assert list(shard.owners) == sorted(shard.owners)
        for p, start, numel, owner in zip(shard.params, shard.starts, shard.numels, shard.owners,
                                          strict=True):
            covered.setdefault(p, []).append((start, numel, owner))
    for p, pieces in covered.items():
        pieces.sort()
        assert [s for s, _, _ in pieces] == [0] + [s + k for s, k, _ in pieces[:-1]]  # contiguous
        assert sum(k for _, k, _ in pieces) == numels[p]
        assert len({o for _, _, o in pieces}) == len(pieces)  # one piece per owner at most
        assert plan.owner[p] == (pieces[0][2] if len(pieces) == 1 else -1)


def test_split_keeps_uncuttable_and_empty_parameters_whole() -> None:
    # a non-contiguous parameter (cuttable False) stays whole in the range where it starts; a
    # zero-size one still gets an entry (the reducer lays out every parameter)
    plan = plan_shards([[0, 1, 2, 3]], [10, 60, 0, 30], [4] * 4, 2, split=True,
                       cuttable=[True, False, True, True])
    # ranges of 50: [0, 10) and the uncuttable [10, 70) start in range 0; the empty one at 70
    # and [70, 100) in range 1: nothing is cut
    assert plan.owner == (0, 0, 1, 1) and plan.owned_bytes == (280, 120)
    assert plan.buckets[0].numels == (10, 60, 0, 30)
    cut = plan_shards([[0, 1, 2, 3]], [10, 60, 0, 30], [4] * 4, 2, split=True)
    assert cut.owner == (0, -1, 1, 1) and cut.owned_bytes == (200, 200)  # [10, 70) cut at 50

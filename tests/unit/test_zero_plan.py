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


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("size", [2, 3, 5])
def test_random_layouts_keep_the_bound_and_the_layout(seed: int, size: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    numels = [rng.choice([1, 7, 64, 300, 4096]) for _ in range(n)]
    order = list(range(n))
    buckets, i = [], 0
    while i < n:
        k = rng.randint(1, 6)
        buckets.append(order[i : i + k])
        i += k
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

"""Which ranks share a host: the groups a hierarchical allreduce runs on."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hvd_trainer.comm.ops.process_set import ProcessSet
from hvd_trainer.comm.world.world import World

__all__ = ["HostTopology", "build_topology"]


@dataclass
class HostTopology:
    """This rank's place among H hosts x L ranks, and its two groups.

    Attributes:
        hosts: H, the number of hosts.
        local_size: L, ranks per host (the same on every host).
        local_index: this rank's index among its host's ranks.
        local_group: the ranks of this host (reduce-scatter and allgather run here).
        cross_group: the ranks with this local index, one per host (the slice's allreduce).
        executor: one worker thread; buckets run on it in launch order (the same on every rank).
    """

    hosts: int
    local_size: int
    local_index: int
    local_group: dist.ProcessGroup
    cross_group: dist.ProcessGroup
    executor: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hvd-hier"))


def build_topology(world: World, pset: ProcessSet) -> HostTopology | None:
    """The hosts' groups, or ``None`` where a hierarchy cannot help or is not possible: one host,
    one rank per host, hosts with different numbers of ranks, or a process set smaller than the
    world.

    Collective over the whole world (one allgather, then ``new_group`` for every host and every
    local index, in the same order on every rank); the decision uses only what every rank sees
    alike (the allgathered placement), so no rank skips a collective the others make.
    """
    if pset.size() != world.size or world.size < 2:
        return None
    mine = torch.tensor([world.cross_rank, world.local_rank], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(world.size)]
    dist.all_gather(every, mine, group=world.cpu_group)
    hosts: dict[int, list[int]] = {}
    for rank, t in enumerate(every):
        hosts.setdefault(int(t[0]), []).append(rank)
    sizes = {len(r) for r in hosts.values()}
    if len(hosts) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    members = [sorted(hosts[h]) for h in sorted(hosts)]
    local_size = len(members[0])
    backend = dist.get_backend(world.group)
    local_group = cross_group = None
    for ranks in members:  # every rank creates every group, in the same order
        g = dist.new_group(ranks, backend=backend)
        if world.rank in ranks:
            local_group = g
    for index in range(local_size):
        ranks = [host[index] for host in members]
        g = dist.new_group(ranks, backend=backend)
        if world.rank in ranks:
            cross_group = g
    assert local_group is not None and cross_group is not None
    local_index = next(h.index(world.rank) for h in members if world.rank in h)
    return HostTopology(len(members), local_size, local_index, local_group, cross_group)

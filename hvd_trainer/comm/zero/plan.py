"""Which rank owns which parameter (or which piece of one): ZeRO shards planned over the fused
gradient buckets.

An *entry* of the plan is a parameter owned whole by one rank, or, with ``split=True``, a
contiguous piece of a parameter cut between ranks (its elements ``start .. start+numel`` in
``param.view(-1)`` order). An entry's optimizer state lives only on its owner (and with stage 2
its averaged gradient too). Ownership is planned bucket by bucket over the reducer's layout
(``hvd_trainer.comm.reduce.fusion._assign_buckets``), so a bucket's reduce-scatter hands each rank
exactly the gradients of the parameters it owns.

Algorithm (``N`` ranks, buckets in launch order, sizes in bytes; deterministic, so every rank
computes the same plan without communicating):

1. *Split the bucket*: its parameters, largest first (ties: bucket order), each go to the
   currently smallest of ``N`` groups (greedy LPT). The groups' sizes then differ by at most
   the bucket's largest parameter: ``max_g - min_g <= max_p``. With ``split=True`` (by
   elements, as DeepSpeed's ZeRO partitions its flat buffers) the bucket's ``T`` elements, its
   parameters back to back in bucket order, are cut instead into ``N`` contiguous ranges of
   ``ceil(T/N)`` elements (the last shorter), group ``k`` the entries inside range ``k``: a
   parameter crossing a range boundary becomes one piece per range, so the groups differ by at
   most ``N - 1`` elements whatever the parameters' sizes.
2. *Give the groups to ranks*: the largest group to the rank owning the fewest bytes so far,
   the second largest to the next, ... (ties: lower rank). Pairing large groups with light
   ranks keeps the global spread bounded: if the ranks' loads differed by at most ``S`` before
   and the groups by at most ``D``, afterwards they differ by at most ``max(S, D)``. By
   induction, over the whole model::

       max_r bytes(r) - min_r bytes(r) <= max over buckets of (its largest parameter)

   so each rank owns ``total/N`` bytes within one parameter (hence within one bucket); with
   ``split=True`` within ``N - 1`` elements of one bucket.
3. *Lay the bucket out by owner*: rank ``r``'s parameters first-to-last in the bucket's order,
   followed by one "used" flag per parameter (see :mod:`hvd_trainer.comm.reduce.fusion`), form
   segment ``r`` of ``seg_r`` elements. Segment ``r`` starts at ``r * chunk`` with
   ``chunk = max_r seg_r`` (zeros fill the gap), so the padded bucket is ``N * chunk`` elements
   and ``reduce_scatter`` gives rank ``r`` exactly segment ``r``.
4. *Choose the bucket's collective*: with ``total = sum_r seg_r``, a ring reduce-scatter of the
   padded bucket sends ``(N-1) * chunk`` elements per rank, a ring allreduce of the unpadded one
   ``2 (N-1)/N * total``. The bucket uses reduce-scatter when ``N * chunk <= 2 * total`` (never
   more traffic than today's allreduce), else it stays unpadded (segments back to back) and is
   allreduced, each rank keeping its segment. A bucket holding one large parameter (an
   embedding alone in its bucket) is the usual such case for ``N > 2``.

The same layout carries the updated parameters back after the step: an allgather of the
padded bucket, or for unbalanced buckets one broadcast per owner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BucketShard", "ShardPlan", "plan_shards"]


@dataclass(frozen=True, slots=True)
class BucketShard:
    """The ownership layout of one bucket.

    All sizes are in elements of the bucket's dtype.
    """

    params: tuple[int, ...]
    """Parameter index (into the planned parameter list) of each entry, in the bucket's layout
    order: rank 0's entries first, then rank 1's, ... A parameter cut between ranks appears
    once per piece."""
    owners: tuple[int, ...]
    """Owner rank of each entry of ``params``."""
    numels: tuple[int, ...]
    """Element count of each entry of ``params`` (the piece's for a piece)."""
    starts: tuple[int, ...]
    """Per entry: the offset of its first element in its parameter's flat (``view(-1)``)
    order; 0 for a whole parameter."""
    seg_numel: tuple[int, ...]
    """Per rank: gradient elements it owns in this bucket (without the used flags)."""
    seg_count: tuple[int, ...]
    """Per rank: number of parameters it owns in this bucket."""
    scatter: bool
    """True: the bucket is padded to ``size * chunk`` and reduce-scattered / allgathered;
    False: unpadded, allreduced, parameters broadcast by their owners."""
    size: int
    """Ranks the bucket is sharded over."""

    @property
    def seg_len(self) -> tuple[int, ...]:
        """Per rank: segment length (gradients + used flags)."""
        return tuple(n + c for n, c in zip(self.seg_numel, self.seg_count, strict=True))

    @property
    def chunk(self) -> int:
        """Length of each rank's padded segment (``max_r seg_len[r]``)."""
        return max(self.seg_len, default=0)

    @property
    def seg_start(self) -> tuple[int, ...]:
        """Per rank: where its segment starts in the bucket buffer."""
        if self.scatter:
            return tuple(r * self.chunk for r in range(self.size))
        starts, acc = [], 0
        for length in self.seg_len:
            starts.append(acc)
            acc += length
        return tuple(starts)

    @property
    def buffer_numel(self) -> int:
        """Elements of the bucket buffer (padded when ``scatter``)."""
        return self.size * self.chunk if self.scatter else sum(self.seg_len)

    def offsets(self) -> tuple[int, ...]:
        """Start of each entry of ``params``'s gradient in the bucket buffer."""
        starts = list(self.seg_start)
        out = []
        for owner, numel in zip(self.owners, self.numels, strict=True):
            out.append(starts[owner])
            starts[owner] += numel
        return tuple(out)

    def flag_offsets(self) -> tuple[int, ...]:
        """Position of each entry's "used" flag in the bucket buffer (after its owner's
        gradients)."""
        starts = self.seg_start
        seen = [0] * self.size
        out = []
        for owner in self.owners:
            out.append(starts[owner] + self.seg_numel[owner] + seen[owner])
            seen[owner] += 1
        return tuple(out)


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Ownership of every planned parameter, bucket by bucket."""

    buckets: tuple[BucketShard, ...]
    owner: tuple[int, ...]
    """Owner rank of each planned parameter, by index; ``-1`` for one cut between ranks (its
    pieces' owners are in :attr:`buckets`)."""
    size: int
    """Number of ranks."""
    owned_bytes: tuple[int, ...]
    """Per rank: parameter bytes it owns (what its optimizer state scales with)."""
    by_elements: bool = False
    """Planned with ``split=True`` (parameters may be cut between ranks)."""

    def owned(self, rank: int) -> list[int]:
        """Indices of the parameters ``rank`` owns whole."""
        return [i for i, r in enumerate(self.owner) if r == rank]


def _split(numels: Sequence[int], size: int) -> list[list[int]]:
    """Greedy LPT: positions of ``numels`` into ``size`` groups, largest first."""
    groups: list[list[int]] = [[] for _ in range(size)]
    loads = [0] * size
    for pos in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        g = min(range(size), key=lambda k: (loads[k], k))
        groups[g].append(pos)
        loads[g] += numels[pos]
    return groups


def _cut(numels: Sequence[int], cuttable: Sequence[bool], size: int
         ) -> tuple[list[tuple[int, int, int]], list[list[int]]]:
    """The bucket's elements (``numels`` back to back) in ``size`` contiguous ranges of
    ``ceil(T/size)``: entries ``(position in numels, start, numel)`` and, per range, the
    positions of its entries. A parameter that is not ``cuttable`` (or has no elements) stays
    whole, in the range where it starts."""
    total = sum(numels)
    width = max(1, -(-total // size))
    entries: list[tuple[int, int, int]] = []
    groups: list[list[int]] = [[] for _ in range(size)]
    pos = 0
    for k, n in enumerate(numels):
        lo = pos
        while True:
            r = min(lo // width, size - 1)
            hi = min(pos + n, (r + 1) * width) if cuttable[k] else pos + n
            groups[r].append(len(entries))
            entries.append((k, lo - pos, hi - lo))
            lo = hi
            if lo >= pos + n:
                break
        pos += n
    return entries, groups


def plan_shards(
    buckets: Sequence[Sequence[int]],
    numels: Sequence[int],
    element_sizes: Sequence[int],
    size: int,
    *,
    split: bool = False,
    cuttable: Sequence[bool] | None = None,
) -> ShardPlan:
    """Plan which of ``size`` ranks owns each parameter (see the module docstring).

    Args:
        buckets: the reducer's layout: per bucket, indices into ``numels`` in bucket order.
            Every index appears exactly once.
        numels: element count of each parameter.
        element_sizes: bytes per element of each parameter.
        size: number of ranks (``>= 1``).
        split: cut each bucket by elements into ``size`` equal ranges (parameters crossing a
            boundary become pieces) instead of giving each parameter whole to one rank. Only
            for an optimizer whose update and state are per element (Adam, SGD, ...; see
            :func:`hvd_trainer.comm.zero.pieces.per_element`).
        cuttable: with ``split``, per parameter whether it may be cut (``None``: all); one
            that may not stays whole in the range where it starts (the balance is then within
            the largest such parameter).

    Returns:
        The plan; identical on every rank given the same arguments.

    Raises:
        ValueError: ``size < 1`` or an index missing from / repeated in ``buckets``.
    """
    if size < 1:
        raise ValueError(f"size={size} must be >= 1.")
    flat = [i for b in buckets for i in b]
    if sorted(flat) != list(range(len(numels))):
        raise ValueError("buckets must list every parameter index exactly once.")
    owner = [0] * len(numels)
    load = [0] * size
    shards = []
    for bucket in buckets:
        sizes = [numels[i] for i in bucket]
        if split and size > 1:
            cut, groups = _cut(sizes, [cuttable is None or cuttable[i] for i in bucket], size)
            entries = [(bucket[k], start, n) for k, start, n in cut]
        else:
            entries = [(i, 0, numels[i]) for i in bucket]
            groups = _split(sizes, size)
        nbytes = [sum(entries[e][2] * element_sizes[entries[e][0]] for e in g) for g in groups]
        by_size = sorted(range(size), key=lambda g: (-nbytes[g], g))
        by_load = sorted(range(size), key=lambda r: (load[r], r))
        group_rank = {g: r for g, r in zip(by_size, by_load, strict=True)}
        entry_owner = [0] * len(entries)
        for g, members in enumerate(groups):
            r = group_rank[g]
            load[r] += nbytes[g]
            for e in members:
                entry_owner[e] = r
        for e, (i, _, n) in enumerate(entries):
            owner[i] = entry_owner[e] if n == numels[i] else -1
        ordered = sorted(range(len(entries)), key=lambda e: (entry_owner[e], e))
        seg_numel = [0] * size
        seg_count = [0] * size
        for e in ordered:
            seg_numel[entry_owner[e]] += entries[e][2]
            seg_count[entry_owner[e]] += 1
        seg_len = [n + c for n, c in zip(seg_numel, seg_count, strict=True)]
        scatter = size > 1 and size * max(seg_len) <= 2 * sum(seg_len)
        shards.append(BucketShard(
            params=tuple(entries[e][0] for e in ordered), owners=tuple(entry_owner[e] for e in ordered),
            numels=tuple(entries[e][2] for e in ordered), starts=tuple(entries[e][1] for e in ordered),
            seg_numel=tuple(seg_numel), seg_count=tuple(seg_count), scatter=scatter, size=size,
        ))
    return ShardPlan(tuple(shards), tuple(owner), size, tuple(load), split and size > 1)

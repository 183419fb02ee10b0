"""Hierarchical allreduce (Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``) for H hosts x L ranks.

A bucket of ``S`` bytes is reduce-scattered among the L ranks of each host (loopback or NVLink:
cheap), each local rank allreduces its ``S/L`` slice with the ranks of the same local index on
the other hosts, and the slices are allgathered inside the host again. Each host's port then
carries ``2 (H-1)/H x S`` bytes each way instead of a flat ring's ``2 (N-1)/N x S`` over the
boundary segments (for 2 hosts x 2 ranks: ``S`` instead of ``1.5 S``: 0.67x the wire time).

:mod:`.topology` builds the per-host and per-local-index groups (collective, once);
:mod:`.allreduce` runs the three phases on a worker thread so a bucket's reduction stays
asynchronous, behind the same :class:`~hvd_trainer.comm.ops.reduce.Reduction` and cross-rank
checks as a flat allreduce.
"""

from hvd_trainer.comm.reduce.hierarchical.allreduce import HierarchicalWork, hierarchical_allreduce_
from hvd_trainer.comm.reduce.hierarchical.topology import HostTopology, build_topology

__all__ = ["HierarchicalWork", "HostTopology", "build_topology", "hierarchical_allreduce_"]

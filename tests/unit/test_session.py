"""comm.session: one init/shutdown for every front end, Horovod's init(comm, process_sets)
signature with our keywords, the rank queries in comm, and process sets that hold their rank,
ranks and coordinator instead of the World."""

from __future__ import annotations

import pytest
import torch

import hvd_trainer
import hvd_trainer.torch as hvd_torch
from hvd_trainer import comm
from hvd_trainer.comm.base.config import CommConfig
from hvd_trainer.comm.base.errors import NotInitializedError

QUERIES = ("size", "rank", "local_size", "local_rank", "cross_size", "cross_rank")


def test_every_front_end_uses_the_one_init_and_queries() -> None:
    for name in ("init", "shutdown", "is_initialized", *QUERIES):
        assert getattr(hvd_trainer, name) is getattr(comm, name), name
        assert getattr(hvd_torch, name) is getattr(comm, name), name
        assert name in comm.__all__ and name in hvd_torch.__all__


def test_keyword_init_then_queries_then_shutdown() -> None:
    assert not comm.is_initialized()
    with pytest.raises(NotInitializedError):
        comm.rank()
    world = comm.init(backend="gloo", timeout_seconds=30.0, config=CommConfig(check_signatures=False),
                      environ={})
    try:
        assert comm.init() is world and comm.get_world() is world  # idempotent
        assert [getattr(comm, q)() for q in QUERIES] == [1, 0, 1, 0, 1, 0]
        assert world.runtime.config.check_signatures is False
        assert comm.allreduce(torch.tensor([2.0])).tolist() == [2.0]
    finally:
        comm.shutdown()
    assert not comm.is_initialized() and world.group is None
    comm.shutdown()  # twice is fine


def test_horovod_arguments_are_checked_and_sets_hold_rank_ranks_coordinator() -> None:
    recorded = comm.ProcessSet([0])  # before init: only a description
    assert recorded.process_set_id is None and recorded.coordinator is None
    assert recorded.global_rank is None and not recorded.removed
    with pytest.raises(comm.CommValueError, match=r"ranks \[0, 1\].*HINT"):
        comm.init(comm=[0, 1], environ={})  # the launched world is one process
    with pytest.raises(comm.CommValueError, match=r"duplicates the whole job \(process set 0\).*HINT"):
        comm.init(process_sets=[recorded], environ={})  # [0] is the whole job here
    world = comm.init([0], "dynamic", environ={})
    try:
        pset = comm.ProcessSet([0])
        assert pset.process_set_id == 1
        assert (pset.global_rank, pset.ranks, pset.rank()) == (0, [0], 0)  # a list, as Horovod's
        assert pset.device == world.device and pset.coordinator.rank == 0
        assert not hasattr(pset, "world")  # the set holds what it needs, not the World
        assert comm.allreduce(torch.ones(1), op=comm.Sum, process_set=pset).tolist() == [1.0]
        assert comm.remove_process_set(pset) and pset.removed
        with pytest.raises(comm.CommValueError, match="was removed"):
            comm.allreduce(torch.ones(1), process_set=pset)
        assert not comm.remove_process_set(pset)  # already removed
    finally:
        comm.shutdown()

"""Horovod's process-set registry on 3 gloo processes: static sets passed to
``init(process_sets=...)``, ``global_process_set``, ``add_process_set`` / ``remove_process_set``
(collective over the job), their errors, and ``init(comm=...)``."""

from __future__ import annotations

import torch

from tests.multiproc import run_workers


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _static(hvd, r: int) -> dict:
    import os

    from hvd_trainer.comm.world.world import free_port

    # Start a fresh job on a new port (re-using the old one races with its closing store).
    port = hvd.broadcast_object(free_port() if r == 0 else None, root_rank=0)
    hvd.shutdown()
    os.environ["MASTER_PORT"] = str(port)
    evens, odd = hvd.ProcessSet([2, 0]), hvd.ProcessSet([1])  # recorded, not created yet
    before = (evens.process_set_id, hvd.global_process_set.process_set_id)
    unusable = _error(lambda: hvd.allreduce(torch.ones(1), process_set=evens))
    # a duplicate (the same ranks in another order) refuses the whole list: no id is used up
    duplicate = _error(lambda: hvd.init(process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet([1, 2]),
                                                      hvd.ProcessSet([2, 1])], timeout_seconds=60))
    hvd.init(process_sets=[evens, odd], timeout_seconds=60)
    x = torch.tensor([float(r + 1)])
    mine = evens if r in (0, 2) else odd
    return {
        "before": before,
        "unusable_before_init": unusable,
        "ids": (evens.process_set_id, odd.process_set_id),
        "set_sum": hvd.allreduce(x, op=hvd.Sum, process_set=mine).item(),
        "set_rank": mine.rank(),
        "global": (hvd.global_process_set.size(), hvd.global_process_set.rank(),
                   hvd.global_process_set.included(), list(hvd.global_process_set.ranks)),
        "global_sum": hvd.allreduce(x, op=hvd.Sum, process_set=hvd.global_process_set).item(),
        "global_bcast": hvd.broadcast(x, 2, process_set=hvd.global_process_set).item(),
        "ids_and_ranks": _ids_and_ranks(),
        "duplicate": duplicate,
    }


def _ids_and_ranks() -> dict[int, list[int]]:
    from hvd_trainer.torch import mpi_ops

    return mpi_ops._basics._get_process_set_ids_and_ranks()  # Horovod's internal, as its tests use it


def _dynamic(hvd, r: int) -> dict:
    x = torch.tensor([float(r + 1)])
    pair = hvd.add_process_set([0, 1])
    eager = hvd.ProcessSet([1, 2])  # built after init: works at once
    out = {
        "pair_id": pair.process_set_id,
        "eager_same": hvd.add_process_set(eager) is eager,
        "pair_sum": hvd.allreduce(x, op=hvd.Sum, process_set=pair).item() if pair.included() else None,
        "eager_gather": hvd.allgather(x, process_set=eager).tolist() if eager.included() else None,
        "dup": _error(lambda: hvd.add_process_set([1, 0])),
        "dup_global": _error(lambda: hvd.add_process_set([0, 1, 2])),
        "out_of_range": _error(lambda: hvd.add_process_set([0, 5])),
        "empty": _error(lambda: hvd.add_process_set([])),
        "remove_global": _error(lambda: hvd.remove_process_set(hvd.global_process_set)),
        "removed": hvd.remove_process_set(pair),
        "removed_again": hvd.remove_process_set(pair),
        "id_after_remove": pair.process_set_id,
        "use_removed": _error(lambda: hvd.allreduce(x, process_set=pair)),
    }
    again = hvd.add_process_set([0, 1])  # allowed again once removed
    out["again_id"] = again.process_set_id
    out["again_sum"] = hvd.allreduce(x, op=hvd.Sum, process_set=again).item() if again.included() else None
    out["comm_subset"] = _error(lambda: hvd.init(comm=[0, 1]))
    out["comm_all"] = hvd.init(comm=[2, 1, 0]).size
    out["comm_type"] = _error(lambda: hvd.init(comm="world"))
    asked = [0, 1] if r < 2 else [0, 2]
    out["mismatch"] = _error(lambda: hvd.add_process_set(asked))
    out["after_mismatch"] = hvd.allreduce(x, op=hvd.Sum).item()
    return out


def _run() -> dict:
    import hvd_trainer as hvd

    r = hvd.rank()
    return {**_static(hvd, r), **_dynamic(hvd, r)}


def test_process_set_registry_three_ranks() -> None:
    results = run_workers(_run, 3, timeout_seconds=150)
    for r, res in enumerate(results):
        assert res["before"] == (None, 0)
        assert "not created yet" in res["unusable_before_init"] and "HINT" in res["unusable_before_init"]
        assert res["ids"] == (1, 2)  # after the refused list
        assert "entry 2 (ranks [1, 2]) duplicates entry 1; nothing was created" in res["duplicate"]
        assert res["ids_and_ranks"] == {0: [0, 1, 2], 1: [0, 2], 2: [1]}
        assert res["set_sum"] == (4.0 if r in (0, 2) else 2.0)
        assert res["set_rank"] == {0: 0, 1: 0, 2: 1}[r]
        assert res["global"] == (3, r, True, [0, 1, 2])
        assert res["global_sum"] == 6.0 and res["global_bcast"] == 3.0
        assert res["pair_id"] == 3 and res["eager_same"]
        assert res["pair_sum"] == (None if r == 2 else 3.0)
        assert res["eager_gather"] == (None if r == 0 else [2.0, 3.0])
        assert res["dup"].startswith("CommValueError") and "already has these ranks" in res["dup"]
        assert "process_set_id=0" in res["dup_global"]
        assert "outside a world of size 3" in res["out_of_range"]
        assert "empty" in res["empty"]
        assert "cannot be removed" in res["remove_global"] and "HINT" in res["remove_global"]
        assert res["removed"] is True and res["removed_again"] is False
        assert res["id_after_remove"] is None and "was removed" in res["use_removed"]
        assert res["again_id"] == 5 and res["again_sum"] == (None if r == 2 else 3.0)
        assert "all 3 launched processes" in res["comm_subset"] and "HINT" in res["comm_subset"]
        assert res["comm_all"] == 3 and res["comm_type"].startswith("CommTypeError")
        assert res["mismatch"].startswith("CollectiveMismatchError"), res["mismatch"]
        assert res["after_mismatch"] == 6.0

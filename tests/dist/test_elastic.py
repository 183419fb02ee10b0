"""elastic.State / TorchState / ElasticSampler / run on 2 gloo processes."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.multiproc import run_workers


def _state_checks(tmp: str) -> dict:
    import torch

    import hvd_trainer as hvd
    from hvd_trainer import elastic

    rank = hvd.rank()
    out: dict = {}
    torch.manual_seed(rank)  # different weights per rank before sync
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = elastic.TorchState(model, opt, epoch=rank, note=[rank])
    state.sync()
    w0 = model.weight.detach().clone()
    out["synced_weight"] = w0.tolist()
    out["synced_extra"] = (state.epoch, list(state.note))
    # one step creates momentum; commit; a second step; restore undoes it
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state.epoch = 5
    state.commit()
    committed = model.weight.detach().clone()
    opt.step()
    state.epoch = 6
    state.note.append(99)
    state.restore()
    out["restored_ok"] = torch.equal(model.weight, committed) and state.epoch == 5
    out["momentum_kept"] = "momentum_buffer" in opt.state[model.weight]
    out["note_after_restore"] = state.note
    # random generators: restore() rewinds this process's; sync() leaves each rank its own
    import random

    import numpy as np

    torch.manual_seed(10 + rank)
    random.seed(rank)
    np.random.seed(rank)
    state.commit()
    first = (torch.rand(2).tolist(), random.random(), float(np.random.rand()))
    state.restore()
    out["draws_again"] = (torch.rand(2).tolist(), random.random(), float(np.random.rand())) == first
    state.sync()
    out["after_sync"] = torch.rand(1).item()
    state.restore()  # back to the generators as they were at the sync
    out["after_sync_again"] = torch.rand(1).item()

    # run(): rank 0 persists; a fresh state in the same processes resumes from the file
    @elastic.run(checkpoint_dir=tmp)
    def first(st):
        st.step = 7
        st.commit()
        return st.commit_count

    @elastic.run(checkpoint_dir=tmp)
    def second(st):
        return st.step, st.commit_count, torch.equal(st.model.weight, committed)

    calls = []
    fresh = elastic.TorchState(torch.nn.Linear(3, 2), None, step=0)
    out["first"] = first(fresh)
    torch.manual_seed(100 + rank)
    again = elastic.TorchState(torch.nn.Linear(3, 2), None, step=0)
    again.model.load_state_dict(fresh.model.state_dict()) if rank == 1 else None
    again.register_reset_callbacks([lambda: calls.append("reset")])
    step, count, _ = second(again)
    out["second"] = (step, count, torch.equal(again.model.weight, fresh.model.weight), calls)
    out["files"] = sorted(p.name for p in Path(tmp).iterdir())

    # ElasticSampler: consume 3 batches of 2 per rank in epoch 1, then resume
    sampler = elastic.ElasticSampler(range(20), shuffle=True, seed=3)
    sampler.set_epoch(1)
    taken = []
    for i, idx in enumerate(iter(sampler)):
        if i == 6:
            break
        taken.append(idx)
        if i % 2 == 1:
            sampler.record_batch(i // 2, 2)
    saved = sampler.state_dict()
    resumed = elastic.ElasticSampler(range(20), shuffle=True, seed=3)
    resumed.load_state_dict(saved)
    resumed.set_epoch(1)  # same epoch: keeps the position
    rest = list(iter(resumed))
    out["sampler"] = (taken, rest, saved["processed"], len(resumed))
    return out


def test_elastic_state_sampler_and_run() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        r0, r1 = run_workers(_state_checks, 2, args=(tmp,), timeout_seconds=120)
    assert r0["synced_weight"] == r1["synced_weight"]
    assert r0["synced_extra"] == r1["synced_extra"] == (0, [0])
    import torch

    for rank, r in enumerate((r0, r1)):
        assert r["restored_ok"] and r["momentum_kept"] and r["note_after_restore"] == [0]
        assert r["draws_again"]  # the same numbers after restore()
        torch.manual_seed(10 + rank)
        own = torch.rand(3)[2].item()  # this rank's own stream: the sync sent no generator
        assert r["after_sync"] == r["after_sync_again"] == own
        assert r["first"] == 1
        # resumed from rank 0's file (step 7, 1 commit), weights synced from rank 0
        assert r["second"] == (7, 1, True, ["reset"])
    assert r0["files"] == ["elastic_state.pt"]

    order = torch.randperm(20, generator=torch.Generator().manual_seed(3 + 1)).tolist()
    (t0, rest0, processed, n0), (t1, rest1, _, n1) = r0["sampler"], r1["sampler"]
    assert processed == 12  # 3 batches x 2 samples x 2 ranks
    assert t0 == order[0:12:2] and t1 == order[1:12:2]  # round-robin deal of the order
    assert rest0 == order[12::2] and rest1 == order[13::2] and n0 == n1 == 4
    assert sorted(t0 + t1 + rest0 + rest1) == list(range(20))  # nothing repeated or skipped


def _horovod_sampler_flow() -> dict:
    """Horovod's own ElasticSampler flow (its test_elastic_sampler), on every rank."""
    import torch
    from torch.utils.data import DataLoader

    import hvd_trainer as hvd
    from hvd_trainer import elastic

    size, batch = hvd.size(), 2
    data = list(range(8 * size))
    sampler = elastic.ElasticSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=batch, sampler=sampler)
    state = elastic.TorchState(sampler=sampler)  # no model, no optimizer
    state.sync()
    out: dict = {"start": (state.sampler.epoch, state.sampler.processed_num)}
    counts, batches = [], 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch_idx, _ in enumerate(loader):
            sampler.record_batch(batch_idx, batch)
            counts.append(sampler.processed_num)
            batches += 1
    out["counts"], out["batches"] = counts, batches
    sampler.set_epoch(2)
    sampler.record_batch(0, batch)
    sampler.record_batch(1, batch)
    state.commit()
    sampler.record_batch(2, batch)
    sampler.record_batch(3, batch)
    state.restore()
    out["restored"] = sampler.processed_num
    sampler.record_batch(2, batch)
    state.commit()
    state.sync()
    out["synced"] = (sampler.processed_num, len(sampler))
    out["rest"] = [int(i) for b in loader for i in b]
    out["rest_all"] = sorted(hvd.allgather(torch.tensor(out["rest"])).tolist())
    out["order"] = sampler._order()
    sampler.set_epoch(3)
    out["next_epoch"] = (sampler.processed_num, len(sampler))
    return out


def test_horovod_sampler_flow_with_a_model_free_state() -> None:
    results = run_workers(_horovod_sampler_flow, 2, timeout_seconds=120)
    for r in results:
        assert r["start"] == (0, 0)
        assert r["counts"] == [4, 8, 12, 16] * 2  # batch_size * size per recorded batch
        assert r["batches"] == 8
        assert r["restored"] == 8  # back to the commit (2 batches x 2 x 2 ranks)
        assert r["synced"] == (12, 2)  # 3 batches x 2 x 2 ranks done; 4 left, 2 per rank
        assert r["next_epoch"] == (0, 8)
    assert results[0]["rest_all"] == sorted(results[0]["order"][12:])  # the rest, once each
    assert set(results[0]["rest"]).isdisjoint(results[1]["rest"])


def _newest_node_commit(tmp: str) -> tuple:
    import torch

    import hvd_trainer as hvd
    from hvd_trainer import elastic

    rank = hvd.rank()
    node_dir = Path(tmp) / f"node{rank}"  # every rank is its node's local rank 0 here
    seed = elastic.TorchState(torch.nn.Linear(2, 1), None, step=0)
    seed.attach_file(node_dir / elastic.STATE_FILENAME, writer=True)
    for step in range(1, 3 + 2 * rank):  # node 0 commits up to step 2, node 1 up to step 4
        with torch.no_grad():
            seed.model.weight.fill_(float(step))
        seed.step = step
        seed.commit()
    seed.flush()

    @elastic.run(checkpoint_dir=node_dir)
    def resumed(st):
        return st.step, st.commit_count, st.model.weight.flatten().tolist()

    return resumed(elastic.TorchState(torch.nn.Linear(2, 1), None, step=0))


def test_run_resumes_from_the_newest_commit_of_any_node() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_workers(_newest_node_commit, 2, args=(tmp,), timeout_seconds=120,
                              env={"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    assert results == [(4, 4, [4.0, 4.0])] * 2  # node 1's commit is newer than node 0's (step 2)

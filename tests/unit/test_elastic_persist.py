"""Elastic commits: snapshot before ``commit()`` returns, file written atomically in the background.

One process each (State.commit/restore/flush need no world); the kill test runs a child
process that commits in a loop and is SIGKILLed while a background write is in progress.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hvd_trainer.checkpoint import load_checkpoint
from hvd_trainer.elastic import STATE_FILENAME, ElasticSampler, ObjectState, PersistError, TorchState
from hvd_trainer.elastic.persist import BackgroundWriter, snapshot_to_cpu

REPO = Path(__file__).resolve().parents[2]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))


def test_later_in_place_updates_do_not_reach_a_returned_commit(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    state = TorchState(model, opt, step=1)
    state.attach_file(tmp_path / STATE_FILENAME, writer=True)
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state[model[0].weight]["momentum_buffer"].clone()
    state.commit()
    with torch.no_grad():  # straight after commit() returns, while the write may still run
        for p in model.parameters():
            p.add_(100.0)
        opt.state[model[0].weight]["momentum_buffer"].mul_(-3.0)
    assert state.flush(timeout=60)
    on_disk = load_checkpoint(tmp_path / STATE_FILENAME)
    assert on_disk["commit_count"] == 1
    for key, value in committed.items():
        assert torch.equal(on_disk["state"]["__model__"][key], value), key
    assert torch.equal(on_disk["state"]["__optimizer__"]["state"][0]["momentum_buffer"], momentum)
    state.restore()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in committed.items())
    assert torch.equal(opt.state[model[0].weight]["momentum_buffer"], momentum)


def test_restart_reads_the_last_committed_values(tmp_path: Path) -> None:
    model = _model()
    state = TorchState(model, None, epoch=0)
    state.attach_file(tmp_path / STATE_FILENAME, writer=True)
    for epoch in range(1, 6):  # a burst: newest wins, one write at a time
        with torch.no_grad():
            model[0].weight.fill_(float(epoch))
        state.epoch = epoch
        state.commit()
    state.flush(timeout=60)
    assert 1 <= state._persist.writes <= 5
    fresh = TorchState(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)), None, epoch=0)
    fresh.attach_file(tmp_path / STATE_FILENAME, writer=False)
    assert fresh.load_committed()
    assert fresh.epoch == 5 and fresh.commit_count == 5
    assert torch.equal(fresh.model[0].weight, torch.full((64, 64), 5.0))
    assert torch.equal(fresh.model.state_dict()["1.running_mean"], model.state_dict()["1.running_mean"])


def test_a_failed_background_write_is_raised_with_a_hint(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    state = ObjectState(step=0)
    state.attach_file(blocker / STATE_FILENAME, writer=True)  # its parent is a file: the write fails
    state.commit()
    with pytest.raises(PersistError, match="HINT"):
        state.flush(timeout=60)
    state.flush(timeout=60)  # reported once
    assert state.step == 0 and not blocker.is_dir()


def test_snapshot_shares_no_storage_and_keeps_state_dict_metadata() -> None:
    model = _model()
    sd = model.state_dict()
    snap = snapshot_to_cpu({"m": sd, "pair": (torch.ones(2), [torch.zeros(1)])})
    assert all(snap["m"][k].data_ptr() != v.data_ptr() for k, v in sd.items())
    assert snap["m"]._metadata == sd._metadata  # BatchNorm's version survives
    assert isinstance(snap["pair"], tuple) and torch.equal(snap["pair"][1][0], torch.zeros(1))


def test_writer_flush_waits_for_every_path(tmp_path: Path) -> None:
    writer = BackgroundWriter()
    for i in range(3):
        writer.submit({"i": i, "t": torch.full((1000,), float(i))}, tmp_path / f"f{i}.pt")
    assert writer.flush(timeout=60)
    assert [load_checkpoint(tmp_path / f"f{i}.pt")["i"] for i in range(3)] == [0, 1, 2]


_CHILD = textwrap.dedent("""
    import sys, torch
    from hvd_trainer.elastic import ObjectState
    path = sys.argv[1]
    state = ObjectState(big=torch.zeros(16 * 1024 * 1024), count=0)  # 64 MiB: writes take a while
    state.attach_file(path, writer=True)
    state.count = 1
    state.big.fill_(1.0)
    state.commit()
    state.flush()
    print("READY", flush=True)
    while True:
        state.count += 1
        state.big.fill_(float(state.count))
        state.commit()
""")


def test_sigkill_during_a_background_write_leaves_the_previous_complete_commit(tmp_path: Path) -> None:
    path = tmp_path / STATE_FILENAME
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, env=env,
                             text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "READY"
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(f".{STATE_FILENAME}.*.tmp")):  # a write is in progress
            assert time.monotonic() < deadline, "no background write started within 60 s"
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    data = load_checkpoint(path)  # complete: loads, and its tensor matches its own count
    count = data["commit_count"]
    assert count >= 1 and data["state"]["count"] == count
    assert torch.equal(data["state"]["big"], torch.full((16 * 1024 * 1024,), float(count)))
    fresh = ObjectState(big=torch.zeros(1), count=0)
    fresh.attach_file(path, writer=False)
    assert fresh.load_committed() and fresh.count == count and float(fresh.big[-1]) == count


def test_torch_state_without_a_model_tracks_a_sampler() -> None:
    """Horovod's ``TorchState(sampler=...)``: no model, no optimizer; commit/restore the position."""
    sampler = ElasticSampler(list(range(16)), shuffle=True)
    state = TorchState(sampler=sampler, epoch=0)
    assert state.model is None and state.optimizer is None
    sampler.set_epoch(2)
    sampler.record_batch(0, 2)
    sampler.record_batch(1, 2)
    state.commit()
    sampler.record_batch(2, 2)
    assert sampler.processed_num == 6
    state.restore()
    assert sampler.processed_num == 4 and len(sampler) == 12
    assert sampler.processed_indices == set(sampler._order()[:4])
    assert sampler.get_indices(0, 2) == sampler._order()[4:6]
    with pytest.raises(TypeError, match="state_dict"):
        TorchState(model=object())

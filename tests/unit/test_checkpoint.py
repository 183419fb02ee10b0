"""Atomic checkpoints: round trip, rank-0-only writes, SIGKILL mid-write, Lightning CheckpointIO."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hvd_trainer.checkpoint import atomic_save, discard, load_checkpoint, save_checkpoint
from hvd_trainer.lightning.checkpoint_io import AtomicCheckpointIO

ROOT = Path(__file__).resolve().parents[2]

KILLED_WRITER = textwrap.dedent(
    """
    import sys, time, torch
    from hvd_trainer.checkpoint import atomic_save

    class SlowToPickle:
        # Pickled in the middle of torch.save: announce, then block until killed.
        def __reduce__(self):
            print("WRITING", flush=True)
            time.sleep(120)
            return (int, (0,))

    path = sys.argv[1]
    atomic_save({"step": 1, "w": torch.arange(1000.0)}, path)
    atomic_save({"step": 2, "w": torch.zeros(1000), "slow": SlowToPickle()}, path)
    """
)


def test_round_trip_and_rank0_only(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "a.pt"
    state = {"w": torch.linspace(0, 1, 7, dtype=torch.float64), "step": 3}
    assert atomic_save(state, path) == path
    back = load_checkpoint(path)
    assert back["step"] == 3 and torch.equal(back["w"], state["w"]) and back["w"].dtype == torch.float64
    assert save_checkpoint({"step": 4}, path, rank=1) is False
    assert load_checkpoint(path)["step"] == 3
    assert save_checkpoint({"step": 5}, path) is True  # no world: a single process is rank 0
    assert load_checkpoint(path)["step"] == 5
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.pt"]  # no temp files left


def test_failed_write_keeps_previous_and_cleans_up(tmp_path: Path) -> None:
    path = tmp_path / "a.pt"
    atomic_save({"step": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        atomic_save({"step": 2, "bad": Unpicklable()}, path)
    assert load_checkpoint(path) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]


def test_sigkill_during_write_leaves_previous_checkpoint_readable(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # blocks until the second write is half done
        assert line.strip() == "WRITING", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    back = load_checkpoint(path)
    assert back["step"] == 1 and torch.equal(back["w"], torch.arange(1000.0))
    stray = [p.name for p in tmp_path.iterdir() if p.name != "last.pt"]
    assert len(stray) == 1 and stray[0].startswith(".last.pt.") and stray[0].endswith(".tmp"), stray
    # the end of an elastic job discards its commit: the killed write's temp file goes too, and
    # nothing else does
    (tmp_path / "other.pt").write_bytes(b"x")
    (tmp_path / ".other.pt.abc.tmp").write_bytes(b"x")
    discard(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.pt.abc.tmp", "other.pt"]


def test_lightning_checkpoint_io_is_atomic(tmp_path: Path) -> None:
    from pytorch_lightning import LightningModule, Trainer
    from pytorch_lightning.plugins.environments import LightningEnvironment
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=4)
    io = AtomicCheckpointIO()
    trainer = Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                      # an explicit environment: Lightning's MPI detection imports mpi4py, which
                      # fails on machines without libmpi
                      plugins=[io, LightningEnvironment()],
                      enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path)
    model = Tiny()
    trainer.fit(model, data)
    assert trainer.strategy.checkpoint_io is io
    ckpt = tmp_path / "manual.ckpt"
    trainer.save_checkpoint(ckpt)
    loaded = torch.load(ckpt, weights_only=False)
    assert torch.equal(loaded["state_dict"]["layer.weight"], model.layer.weight.detach())
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})

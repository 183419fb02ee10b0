"""Elastic mode of HorovodStrategy in one process (world size 1): a fit that crashed after a
commit, run again as torchrun's next attempt, resumes from the commit by itself.

The 2-rank SIGKILL scenario under hvdrun is tests/e2e/test_lightning_elastic.py.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset, WeightedRandomSampler

import hvd_trainer
import hvd_trainer.comm as comm
from hvd_trainer.comm import HorovodInternalError
from hvd_trainer.elastic.resumable_loader import ResumableDataLoader
from hvd_trainer.lightning import elastic as lightning_elastic
from hvd_trainer.lightning.elastic import COMMIT_KEY
from hvd_trainer.strategy import HorovodStrategy, StrategyConfigError

N, BATCH, EPOCHS = 40, 4, 3  # 10 steps per epoch


class Crash(RuntimeError):
    pass


class Net(pl.LightningModule):
    def __init__(self, crash_at_step: int = -1, dropout: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), *([nn.Dropout(0.5)] if dropout else []),
                                 nn.Linear(8, 1))
        self.crash_at_step = crash_at_step
        self.random = dropout
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.crash_at_step:
            raise Crash(f"step {self.global_step}")
        x, y, idx = batch
        self.seen.append((self.current_epoch, idx.tolist()))
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.random:  # numpy's and Python's global generators are committed too
            loss = loss * (1.0 + 0.1 * float(np.random.rand()) + 0.1 * random.random())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        assert not isinstance(self.trainer.val_dataloaders, ResumableDataLoader)  # training only
        if self.crash_at_step == -2 and self.global_step == 10 and not self.trainer.sanity_checking:
            raise Crash("validation at the end of epoch 0")
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["seen"] = list(self.seen)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.seen = list(checkpoint["seen"])


@pytest.fixture(autouse=True)
def _attempts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    _attempt(monkeypatch, 0)
    yield
    hvd_trainer.shutdown()


def _attempt(monkeypatch: pytest.MonkeyPatch, attempt: int) -> None:
    """What a new process of torchrun's ``attempt`` sees: the count, and fit calls from 0."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
    monkeypatch.setattr(lightning_elastic, "_FIT_CALLS", itertools.count())


class CustomSampler(RandomSampler):
    """A sampler the resumable loader does not know: epoch-end commits only."""


SAMPLERS = {"random": lambda d: RandomSampler(d), "custom": lambda d: CustomSampler(d),
            "weighted": lambda d: WeightedRandomSampler(torch.linspace(1.0, 2.0, len(d)), len(d))}


def _fit(directory: Path | None, crash_at_step: int = -1, *, sampler: str | None = None,
         dropout: bool = False, ckpt_path: str | None = None, root: Path | None = None,
         accelerator: str = "cpu", every: int = 3, **kwargs: Any) -> tuple[pl.Trainer, Net]:
    """One fit; ``crash_at_step`` -2 crashes in the validation after step 10 (epoch 0's end)."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 3, generator=g), torch.randn(N, 1, generator=g), torch.arange(N))
    loader = (DataLoader(data, batch_size=BATCH, sampler=SAMPLERS[sampler](data)) if sampler
              else DataLoader(data, batch_size=BATCH, shuffle=True))
    trainer = pl.Trainer(
        strategy=HorovodStrategy(elastic_checkpoint_dir=directory, elastic_commit_every_n_steps=every),
        accelerator=accelerator, devices=1, max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=sampler is None,
        default_root_dir=root, **kwargs,
    )
    model = Net(crash_at_step, dropout)
    with contextlib.suppress(Crash):
        trainer.fit(model, loader, DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    return trainer, model


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize(
    ("crash_at_step", "last_commit", "kwargs"),
    [
        (14, 12, {}),  # mid-epoch 1 (commits every 3 steps)
        (10, 10, {}),  # first batch after the epoch-end commit
        (7, 6, dict(accumulate_grad_batches=2, val_check_interval=4)),  # 5 steps per epoch
    ],
)
def test_restarted_attempt_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           crash_at_step: int, last_commit: int, kwargs: dict) -> None:
    _, ref = _fit(tmp_path / "ref", **kwargs)
    _attempt(monkeypatch, 0)
    _fit(tmp_path / "run", crash_at_step, **kwargs)
    commit = torch.load(tmp_path / "run" / "lightning_fit0.ckpt", weights_only=False)
    assert commit["global_step"] == last_commit and commit[COMMIT_KEY]["run_id"] == "job-a"
    _attempt(monkeypatch, 1)
    trainer, got = _fit(tmp_path / "run", **kwargs)
    assert trainer.ckpt_path == str(tmp_path / "run" / "lightning_fit0.ckpt")  # resumed by itself
    assert trainer.global_step == EPOCHS * N // BATCH // kwargs.get("accumulate_grad_batches", 1)
    assert _same_weights(ref, got)
    assert got.seen == ref.seen  # the same batches in the same order: none twice, none skipped
    for epoch in range(EPOCHS):
        assert sorted(i for e, b in got.seen if e == epoch for i in b) == list(range(N))


@pytest.mark.parametrize(
    ("crash_at_step", "kwargs"),
    [
        (14, {}),  # mid-epoch commit of step 12: RNG restored after the resumed iterator exists
        (10, {}),  # epoch-end commit: restored before the iterator of epoch 1 is created
        (7, dict(accumulate_grad_batches=2, val_check_interval=4)),
        (10, dict(accumulate_grad_batches=2, val_check_interval=4)),
        (14, dict(sampler="random")),  # the RandomSampler's epoch order is drawn again
        (13, dict(sampler="weighted")),
        (11, dict(sampler="custom")),  # epoch-end commit only: restored before the iterator
        (-2, dict(every=5)),  # killed in epoch 0's last validation: before its epoch-end commit
    ],
)
def test_resume_draws_the_same_random_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              crash_at_step: int, kwargs: dict) -> None:
    """Dropout masks, numpy/Python draws, a random sampler's permutation and the loader's seed
    continue as in an uninterrupted run: the random states of the commit are restored where it
    left off."""
    pl.seed_everything(123)  # the process's RNGs before fit
    _, ref = _fit(tmp_path / "ref", dropout=True, **kwargs)
    _attempt(monkeypatch, 0)
    pl.seed_everything(123)
    _fit(tmp_path / "run", crash_at_step, dropout=True, **kwargs)
    commit = torch.load(tmp_path / "run" / "lightning_fit0.ckpt", weights_only=True)  # as fit(ckpt_path=)
    assert [set(s) for s in commit[COMMIT_KEY]["rng"]] == [{"torch", "cuda", "numpy", "python", "sampler"}]
    _attempt(monkeypatch, 1)
    pl.seed_everything(123)  # a restarted process: the start's states, not those at the commit
    trainer, got = _fit(tmp_path / "run", dropout=True, **kwargs)
    assert trainer.ckpt_path is not None
    assert trainer.global_step == EPOCHS * N // BATCH // kwargs.get("accumulate_grad_batches", 1)
    assert got.seen == ref.seen
    assert _same_weights(ref, got)
    if crash_at_step == -2:  # step 5's commit: none after an epoch's last batch, the epoch-end one never came
        assert (commit["global_step"], commit[COMMIT_KEY]["commit"]) == (5, 1)
    if kwargs.get("sampler") in ("random", "weighted"):  # resumed mid-epoch, not at an epoch end
        assert commit[COMMIT_KEY]["batch"] > 0 and commit[COMMIT_KEY]["rng"][0]["sampler"] is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_dropout_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA dropout masks come from the CUDA generator: committed and restored too (NCCL world of one)."""
    kwargs = dict(dropout=True, accelerator="gpu")
    pl.seed_everything(123)
    _, ref = _fit(tmp_path / "ref", **kwargs)
    _attempt(monkeypatch, 0)
    pl.seed_everything(123)
    _fit(tmp_path / "run", 14, **kwargs)
    commit = torch.load(tmp_path / "run" / "lightning_fit0.ckpt", weights_only=True)
    assert len(commit[COMMIT_KEY]["rng"][0]["cuda"]) == torch.cuda.device_count()
    _attempt(monkeypatch, 1)
    pl.seed_everything(123)
    trainer, got = _fit(tmp_path / "run", **kwargs)
    assert trainer.ckpt_path is not None and got.seen == ref.seen
    assert _same_weights(ref, got)


def test_resumed_twice_across_an_epoch_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed in epoch 0's last validation, resumed, killed mid-epoch 1, resumed again: the
    second resume continues epoch 1 mid-epoch (Lightning starts the epoch after a resume from a
    last-batch commit without counting it as started, so no such commit is made)."""
    _, ref = _fit(tmp_path / "ref", every=2)
    _attempt(monkeypatch, 0)
    _fit(tmp_path / "run", -2, every=2)
    _attempt(monkeypatch, 1)
    _fit(tmp_path / "run", 14, every=2)
    _attempt(monkeypatch, 2)
    trainer, got = _fit(tmp_path / "run", every=2)
    assert trainer.ckpt_path is not None and got.seen == ref.seen
    assert _same_weights(ref, got)


@pytest.mark.parametrize(("failures", "every"),
                         [((14,), 3), ((10, 14), 2), ((-2, 14), 2), ((0, 5, 12, 25), 2)])
def test_in_process_recovery_runs_fit_again_from_the_commit_in_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failures: tuple[int, ...], every: int) -> None:
    """The strategy's launcher under ``hvdrun --recovery in-process``, in one process: each peer
    failure (``HorovodInternalError`` from ``training_step`` at these global steps; -2: in epoch
    0's last validation) re-forms the world (here ``comm.recover`` returns the same world of one:
    the membership rounds need hvdrun, see tests/e2e/test_lightning_inprocess.py) and fit runs
    again from the last commit in memory, ending exactly as an uninterrupted fit."""
    _, ref = _fit(tmp_path / "ref", every=every)
    monkeypatch.setenv("HVDRUN_RECOVERY", "in-process")
    monkeypatch.setattr(comm, "in_process_recovery", lambda: True)
    monkeypatch.setattr(comm, "recover", comm.get_world)
    left = list(failures)

    def fail(module: Net, at: int) -> None:
        if left and at == left[0] and not module.trainer.sanity_checking:
            left.pop(0)
            raise HorovodInternalError(f"a peer was lost at step {module.global_step}")

    training_step, validation_step = Net.training_step, Net.validation_step

    def failing_training_step(self: Net, *args: Any) -> torch.Tensor:
        fail(self, self.global_step)
        return training_step(self, *args)

    def failing_validation_step(self: Net, *args: Any) -> None:
        if self.global_step == 10:  # -2: the validation at epoch 0's end
            fail(self, -2)
        validation_step(self, *args)

    monkeypatch.setattr(Net, "training_step", failing_training_step)
    monkeypatch.setattr(Net, "validation_step", failing_validation_step)
    trainer, got = _fit(tmp_path / "run", every=every)
    assert left == [] and trainer.ckpt_path == lightning_elastic.MEMORY_CHECKPOINT
    assert got.seen == ref.seen and trainer.global_step == ref.trainer.global_step
    assert _same_weights(ref, got)
    assert not (tmp_path / "run" / "lightning_fit0.ckpt").exists()  # commits stay in memory


def test_a_peer_failure_after_the_launchers_sigterm_is_not_recovered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under in-process recovery torchrun sends SIGTERM only when the job is ending (a worker
    exited): the peer failure the signal handler then raises ends fit, not a re-formed world."""
    monkeypatch.setenv("HVDRUN_RECOVERY", "in-process")
    monkeypatch.setattr(comm, "in_process_recovery", lambda: True)
    recovered: list[int] = []

    def recover() -> None:  # a re-formed world would train on: fail at once instead of hanging
        recovered.append(1)
        raise RuntimeError("recovered in process after the launcher's SIGTERM")

    monkeypatch.setattr(comm, "recover", recover)
    training_step = Net.training_step

    def stopped_step(self: Net, *args: Any) -> torch.Tensor:
        if self.global_step == 5:
            self.trainer._signal_connector.received_sigterm = True  # what the SIGTERM handler sets first
            raise HorovodInternalError("rank 1 is no longer running")
        return training_step(self, *args)

    monkeypatch.setattr(Net, "training_step", stopped_step)
    with pytest.raises(HorovodInternalError, match="no longer running"):
        _fit(tmp_path / "run")
    assert recovered == []


def test_commit_of_another_world_size_skips_random_states(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _fit(tmp_path, 14, dropout=True)
    path = tmp_path / "lightning_fit0.ckpt"
    commit = torch.load(path, weights_only=True)
    commit[COMMIT_KEY]["rng"] *= 2  # as if two ranks had committed
    torch.save(commit, path)
    _attempt(monkeypatch, 1)
    with pytest.warns(UserWarning, match="made by 2 ranks, this attempt has 1: random number generators "
                                         "are not restored"):
        trainer, _ = _fit(tmp_path, dropout=True)
    assert trainer.ckpt_path == str(path) and trainer.global_step == EPOCHS * N // BATCH


def test_first_attempt_and_other_jobs_never_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fit(tmp_path, crash_at_step=7)  # job-a leaves a commit of step 6
    _attempt(monkeypatch, 1)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    trainer, _ = _fit(tmp_path, crash_at_step=5)  # job-b's attempt 1: job-a's commit is not its own
    assert trainer.ckpt_path is None
    assert torch.load(tmp_path / "lightning_fit0.ckpt", weights_only=False)["global_step"] == 3
    _attempt(monkeypatch, 0)  # a new job-b: its first attempt deletes any commit at the path
    trainer, _ = _fit(tmp_path, crash_at_step=2)
    assert trainer.ckpt_path is None and not (tmp_path / "lightning_fit0.ckpt").exists()


def test_explicit_ckpt_path_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, _ = _fit(tmp_path / "a")  # finished: its explicit directory keeps the last commit
    done = tmp_path / "a" / "lightning_fit0.ckpt"
    assert torch.load(done, weights_only=False)["global_step"] == 30
    _attempt(monkeypatch, 0)
    _fit(tmp_path / "b", crash_at_step=4)
    _attempt(monkeypatch, 1)
    trainer, _ = _fit(tmp_path / "b", ckpt_path=str(done))
    assert trainer.ckpt_path == str(done)


def test_automatic_directory_falls_back_to_root_and_is_cleaned(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's static rendezvous
    commit = tmp_path / "hvd_elastic" / "lightning_fit0.ckpt"
    _fit(None, crash_at_step=4, root=tmp_path)
    assert commit.exists()
    _attempt(monkeypatch, 1)
    trainer, _ = _fit(None, root=tmp_path)
    assert trainer.ckpt_path == str(commit) and not commit.parent.exists()  # removed after fit


def test_unresumable_loader_commits_at_epoch_ends_only(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="cannot resume mid-epoch exactly: its sampler CustomSampler"):
        _fit(tmp_path, crash_at_step=15, sampler="custom")
    commit = torch.load(tmp_path / "lightning_fit0.ckpt", weights_only=False)
    assert commit[COMMIT_KEY]["commit"] == 1 and commit["global_step"] == 10  # end of epoch 0
    assert (commit[COMMIT_KEY]["epoch"], commit[COMMIT_KEY]["batch"]) == (1, 0)


def test_elastic_switch_and_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    assert HorovodStrategy().elastic is True  # TORCHELASTIC_MAX_RESTARTS=1
    assert HorovodStrategy(elastic=False).elastic is False
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert HorovodStrategy().elastic is False and HorovodStrategy(elastic=True).elastic is True
    monkeypatch.setenv("HVDRUN_RECOVERY", "in-process")  # torchrun never restarts; hvdrun's entry does
    assert HorovodStrategy().elastic is True and HorovodStrategy(elastic=False).elastic is False
    for kwargs, needle in [
        (dict(elastic="yes"), "elastic='yes'"),
        (dict(elastic_checkpoint_dir="s3://bucket/x"), "elastic_checkpoint_dir='s3://bucket/x'"),
        (dict(elastic_checkpoint_dir=3), "elastic_checkpoint_dir=3"),
        (dict(elastic_commit_every_n_steps=-1), "elastic_commit_every_n_steps=-1"),
        (dict(elastic_commit_every_n_steps=True), "elastic_commit_every_n_steps=True"),
    ]:
        with pytest.raises(StrategyConfigError, match=needle) as info:
            HorovodStrategy(**kwargs)
        assert "HINT" in str(info.value)

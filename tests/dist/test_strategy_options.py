"""Strategy options on 2 gloo processes, each against 1 process with the global batch:

* ``sync_batchnorm=True``: BatchNorm statistics over the global batch, so 2 ranks x batch b equal
  1 process x batch 2b (weights and running stats);
* ``HorovodStrategy(compression="bf16")``: gradients travel as bf16, weights stay within bf16
  rounding of the fp32 reference and bit-identical across ranks;
* ranks with different numbers of training batches per epoch: a clear ``UnevenBatchesError`` on
  every rank at the start of ``fit`` instead of a hang at the end of the first epoch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from hvd_trainer.strategy import HorovodStrategy
from tests.dist._lightning_cases import IN_FEATURES, TORCHRUN_ENV, Net, make_data, trainer
from tests.multiproc import run_workers


class BNNet(Net):
    def __init__(self, optimizer: str = "momentum", lr: float = 0.1, init_seed: int = 0) -> None:
        super().__init__(optimizer, lr, init_seed)
        torch.manual_seed(init_seed)
        self.body = nn.Sequential(
            nn.Linear(IN_FEATURES, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)
        )


def _state(module: nn.Module) -> np.ndarray:
    tensors = [t.detach().reshape(-1).double() for t in module.state_dict().values() if t.is_floating_point()]
    return torch.cat(tensors).numpy()


class _SeesSyncBN(pl.Callback):
    """Records whether the module trains with our SyncBatchNorm (Lightning reverts it after fit)."""

    converted = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        from hvd_trainer.torch.sync_batchnorm import SyncBatchNorm

        self.converted = any(isinstance(m, SyncBatchNorm) for m in pl_module.modules())


def _worker() -> dict[str, Any]:
    import hvd_trainer

    world, steps, b = hvd_trainer.size(), 4, 4
    data = make_data(world * b * steps)
    model = BNNet(init_seed=hvd_trainer.rank())
    seen = _SeesSyncBN()
    t = trainer(distributed=True, max_steps=steps, sync_batchnorm=True, callbacks=[seen])
    sampler = DistributedSampler(data, num_replicas=world, rank=hvd_trainer.rank(), shuffle=False)
    t.fit(model, DataLoader(data, batch_size=b, sampler=sampler))
    converted = seen.converted
    ref = BNNet(init_seed=0)
    trainer(distributed=False, max_steps=steps).fit(ref, DataLoader(data, batch_size=world * b))
    out = {"dist": _state(model), "ref": _state(ref), "converted": converted}

    plain = Net("sgd", init_seed=hvd_trainer.rank())
    t = trainer(distributed=False, max_steps=steps)
    ref_plain = Net("sgd", init_seed=0)
    t.fit(ref_plain, DataLoader(data, batch_size=world * b))
    t = pl.Trainer(
        strategy=HorovodStrategy(compression="bf16"), accelerator="cpu", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        max_steps=steps,
    )
    t.fit(plain, DataLoader(data, batch_size=b, sampler=sampler))
    out["bf16"] = _state(plain)
    out["bf16_ref"] = _state(ref_plain)
    out.update(_uneven_batches(b))
    return out


def _uneven_batches(b: int) -> dict[str, Any]:
    """Rank 0 has 6 batches per epoch, rank 1 has 5 (no distributed sampler)."""
    import hvd_trainer
    from hvd_trainer.strategy import UnevenBatchesError

    data = make_data(b * (6 - hvd_trainer.rank()), seed=hvd_trainer.rank())
    out: dict[str, Any] = {}
    try:
        trainer(distributed=True, max_epochs=2, use_distributed_sampler=False).fit(
            Net("sgd"), DataLoader(data, batch_size=b)
        )
        out["uneven_error"] = None
    except UnevenBatchesError as err:
        out["uneven_error"] = str(err)
    # max_steps ends training before the shorter rank's epoch does: allowed, and it finishes
    model = Net("sgd", init_seed=hvd_trainer.rank())
    trainer(distributed=True, max_steps=5, use_distributed_sampler=False).fit(
        model, DataLoader(data, batch_size=b)
    )
    out["short_run"] = _state(model)
    out["iterable"] = _uneven_iterable(b)
    return out


class _Shard(torch.utils.data.IterableDataset):
    """An unsized shard: rank 0 yields 6 batches' worth of rows, rank 1 yields 5."""

    def __init__(self, rows: int) -> None:
        self.data = make_data(rows)

    def __iter__(self):  # noqa: ANN204
        return iter(zip(*self.data.tensors, strict=True))


def _uneven_iterable(b: int) -> str:
    """Unequal IterableDataset shards: an error at the first epoch end, on both ranks."""
    import hvd_trainer

    shard = _Shard(b * (6 - hvd_trainer.rank()))
    try:
        trainer(distributed=True, max_epochs=3, use_distributed_sampler=False).fit(
            Net("sgd"), DataLoader(shard, batch_size=b)
        )
    except Exception as err:  # noqa: BLE001 - the type and text are the result
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    # The unsized shards' case ends when the rank still training gives up waiting on the rank that
    # left: after the process group's timeout, 20 s here rather than the harness's 60.
    return run_workers(_worker, 2, env={**TORCHRUN_ENV, "HVD_TEST_PG_TIMEOUT": "20"}, timeout_seconds=240)


def test_sync_batchnorm_and_bf16_compression_match_the_global_batch(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["converted"]
        assert np.abs(res["dist"] - res["ref"]).max() <= 1e-5
        err = np.abs(res["bf16"] - res["bf16_ref"]).max()
        assert 0 < err <= 5e-3  # bf16 keeps 8 mantissa bits: close to fp32, not equal
    assert np.array_equal(results[0]["dist"], results[1]["dist"])


def test_uneven_batches_per_rank_is_a_clear_error_on_every_rank(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["uneven_error"] is not None
        assert "rank 0: 6, rank 1: 5" in res["uneven_error"]
        assert "limit_train_batches=5" in res["uneven_error"]
    assert np.array_equal(results[0]["short_run"], results[1]["short_run"])
    # unsized shards: the rank that ends its epoch first, and the one still training, both stop
    # (a rank that sees the peer leave after its error reports RankFailedError naming it)
    errors = [res["iterable"] for res in results]
    kinds = ("UnevenBatchesError", "CollectiveMismatchError", "RankFailedError")
    assert all(e.startswith(kinds) for e in errors), errors
    assert any("hvd_trainer.train_epoch_end" in e or "rank 0: 6, rank 1: 5" in e for e in errors), errors
    assert np.array_equal(results[0]["bf16"], results[1]["bf16"])

"""Lightning 1.x habits (hvd_trainer/lightning/porting.py), in one process (no collective runs).

``Trainer()`` with Horovod's launcher variables picks ``"horovod"`` and says so; without them, or
with an explicit ``strategy=``, Lightning's choice is untouched; ``accelerator="horovod"`` raises
with a HINT.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy

import hvd_trainer  # noqa: F401  (registers "horovod" and the habits)
from hvd_trainer.lightning.porting import LightningPortingError, horovod_launched
from hvd_trainer.strategy import HorovodStrategy

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID",
                 "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE")


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def horovod_vars(no_launcher: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """What horovodrun (and hvdrun) export to a single worker."""
    for name, value in {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1", "HOROVOD_LOCAL_RANK": "0",
                        "HOROVOD_LOCAL_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)


def _trainer(**kwargs: Any) -> pl.Trainer:
    defaults = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
    return pl.Trainer(**{**defaults, **kwargs})


def test_horovod_launched_reads_horovod_rank_and_size() -> None:
    assert horovod_launched({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"})
    assert not horovod_launched({"HOROVOD_RANK": "1"})
    assert not horovod_launched({"RANK": "1", "WORLD_SIZE": "2"})


def test_auto_strategy_without_horovod_vars_is_lightnings(no_launcher: None) -> None:
    assert isinstance(_trainer(accelerator="cpu").strategy, SingleDeviceStrategy)


def test_auto_strategy_under_horovod_launcher_is_horovod(
    horovod_vars: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        strategy = _trainer().strategy
    assert type(strategy) is HorovodStrategy
    said = [r.getMessage() for r in caplog.records if "strategy='horovod'" in r.getMessage()]
    assert len(said) == 1 and "hvdrun/horovodrun" in said[0] and "HOROVOD_SIZE=1" in said[0]


def test_explicit_strategy_under_horovod_launcher_is_kept(horovod_vars: None) -> None:
    assert type(_trainer(accelerator="cpu", strategy="ddp").strategy) is DDPStrategy
    assert isinstance(_trainer(accelerator="cpu", strategy="single_device").strategy, SingleDeviceStrategy)


def test_removed_trainer_arguments_are_met_on_import() -> None:
    """``import hvd_trainer`` (or hvdrun's workers) installs porting_args into Lightning's Trainer."""
    import pytorch_lightning as pl

    import hvd_trainer.strategy  # noqa: F401  (the registration installs the porting habits)
    from hvd_trainer.lightning.porting import LightningPortingError

    assert pl.Trainer.__init__._hvd_trainer_removed_args is True
    with pytest.raises(LightningPortingError, match=r"accelerator='gpu', devices=2"):
        pl.Trainer(gpus=2)


def test_accelerator_horovod_raises_with_hint(no_launcher: None) -> None:
    hint = r"HINT: Trainer\(strategy='horovod', accelerator='cpu'\)"
    with pytest.raises(LightningPortingError, match=hint):
        _trainer(accelerator="horovod")


def test_accelerator_horovod_is_never_listed_as_available(no_launcher: None) -> None:
    from pytorch_lightning.accelerators import AcceleratorRegistry

    assert "horovod" in AcceleratorRegistry
    assert AcceleratorRegistry["horovod"]["accelerator"].is_available() is False
    # Lightning's own error for an unusable accelerator lists the available ones: not ours
    with pytest.raises(Exception, match="can not run on your system") as err:
        _trainer(accelerator="mps")
    assert "horovod" not in str(err.value)

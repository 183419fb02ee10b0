"""Trainer arguments Lightning 2.0 removed (hvd_trainer/lightning/porting_args.py), in one process.

``Trainer(gpus=2)`` raises LightningPortingError with the 2.x spelling instead of Python's
``TypeError: unexpected keyword argument 'gpus'``; unknown arguments stay a TypeError; the
wrapped ``__init__`` keeps Lightning's signature.
"""

from __future__ import annotations

import inspect

import pytest
import pytorch_lightning as pl
from pytorch_lightning.trainer.connectors.accelerator_connector import _AcceleratorConnector

import hvd_trainer  # noqa: F401  (registers "horovod" and the habits)
from hvd_trainer.lightning import porting_args
from hvd_trainer.lightning.porting import LightningPortingError

REMOVED = "is Lightning 1.x's spelling, removed in Lightning 2.0. HINT: "
ON_HVDRUN = (" (under hvdrun/horovodrun, leave devices= out: each process trains on one GPU, "
             "cuda:<local rank>)")


@pytest.fixture(autouse=True)
def installed() -> None:
    # What hvd_trainer.lightning.porting.install does for each Lightning package (idempotent).
    porting_args.install_from_connector(_AcceleratorConnector, LightningPortingError)


CASES = [
    (dict(gpus=2), "Trainer(gpus=2) " + REMOVED
     + "Trainer(accelerator='gpu', devices=2, strategy='horovod')" + ON_HVDRUN + "."),
    (dict(accelerator="horovod", gpus=1), "Trainer(gpus=1, accelerator='horovod') " + REMOVED
     + "Trainer(accelerator='gpu', devices=1, strategy='horovod')" + ON_HVDRUN + "."),
    (dict(gpus=[0, 1], strategy="ddp"), "Trainer(gpus=[0, 1]) " + REMOVED
     + "Trainer(accelerator='gpu', devices=[0, 1], strategy='ddp')."),
    (dict(gpus=0), "Trainer(gpus=0) " + REMOVED + "Trainer(accelerator='cpu', strategy='horovod')."),
    (dict(num_processes=2), "Trainer(num_processes=2) " + REMOVED
     + "Trainer(accelerator='cpu', devices=2, strategy='horovod')."),
    (dict(tpu_cores=8), "Trainer(tpu_cores=8) " + REMOVED + "Trainer(accelerator='tpu', devices=8)."),
    (dict(gpus=2, auto_select_gpus=True), "Trainer(gpus=2, auto_select_gpus=True) " + REMOVED
     + "Trainer(accelerator='cuda', devices=find_usable_cuda_devices(2), strategy='horovod'); "
       "from pytorch_lightning.accelerators import find_usable_cuda_devices" + ON_HVDRUN + "."),
    (dict(distributed_backend="horovod"), "Trainer(distributed_backend='horovod') " + REMOVED
     + "Trainer(strategy='horovod')."),
    (dict(replace_sampler_ddp=False), "Trainer(replace_sampler_ddp=False) " + REMOVED
     + "Trainer(use_distributed_sampler=False)."),
    (dict(resume_from_checkpoint="last.ckpt"), "Trainer(resume_from_checkpoint='last.ckpt') " + REMOVED
     + "Trainer() without resume_from_checkpoint; trainer.fit(model, ckpt_path='last.ckpt')."),
    (dict(auto_scale_batch_size="binsearch"), "Trainer(auto_scale_batch_size='binsearch') " + REMOVED
     + "Trainer() without auto_scale_batch_size; Tuner(trainer).scale_batch_size(model, mode='binsearch') "
       "before fit (from pytorch_lightning.tuner import Tuner)."),
    (dict(progress_bar_refresh_rate=0, weights_summary=None),
     "Trainer(progress_bar_refresh_rate=0, weights_summary=None) " + REMOVED
     + "Trainer(enable_progress_bar=False, enable_model_summary=False)."),
    (dict(progress_bar_refresh_rate=10, weights_summary="full"),
     "Trainer(progress_bar_refresh_rate=10, weights_summary='full') " + REMOVED
     + "Trainer(callbacks=[TQDMProgressBar(refresh_rate=10), ModelSummary(max_depth=-1)]); "
       "from pytorch_lightning.callbacks import TQDMProgressBar; "
       "from pytorch_lightning.callbacks import ModelSummary."),
    (dict(track_grad_norm=2), "Trainer(track_grad_norm=2) " + REMOVED
     + "Trainer() without track_grad_norm; self.log_dict(grad_norm(self, norm_type=2)) in "
       "on_before_optimizer_step (from pytorch_lightning.utilities import grad_norm)."),
    (dict(amp_backend="native"), "Trainer(amp_backend='native') " + REMOVED
     + "Trainer() without amp_backend; precision='16-mixed' is torch's AMP, Lightning 2.x's only one "
       "(apex is gone)."),
]


@pytest.mark.parametrize(("kwargs", "message"), CASES)
def test_removed_arguments_raise_the_porting_error_with_the_2x_call(kwargs: dict, message: str) -> None:
    with pytest.raises(LightningPortingError) as info:
        pl.Trainer(logger=False, **kwargs)
    assert str(info.value) == message


def test_under_hvdrun_no_devices_are_proposed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    with pytest.raises(LightningPortingError) as info:
        pl.Trainer(logger=False, gpus=2)
    assert str(info.value) == (
        "Trainer(gpus=2) " + REMOVED + "Trainer(accelerator='gpu', strategy='horovod') "
        "(each process hvdrun/horovodrun starts trains on one GPU, cuda:<local rank>).")


def test_gpus_is_no_longer_pythons_type_error() -> None:
    with pytest.raises(LightningPortingError) as info:
        pl.Trainer(gpus=2)
    assert not isinstance(info.value, TypeError)
    assert "unexpected keyword argument" not in str(info.value)


def test_other_unknown_arguments_stay_pythons_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'gpu_count'"):
        pl.Trainer(gpu_count=2)


def test_every_listed_argument_is_one_lightning_removed() -> None:
    # the table intercepts only what this Lightning rejects; an argument it accepts again is passed on
    accepted = set(inspect.signature(pl.Trainer.__init__).parameters)
    assert not accepted & set(porting_args.REMOVED_TRAINER_ARGS)
    listed = porting_args.REMOVED_TRAINER_ARGS.keys()
    assert {"gpus", "tpu_cores", "num_processes", "auto_select_gpus"} <= listed


def test_wrapper_keeps_lightnings_signature_and_is_installed_once() -> None:
    init = pl.Trainer.__init__
    assert getattr(init, "_hvd_trainer_removed_args", False) is True
    assert "accelerator" in inspect.signature(init).parameters  # LightningCLI reads it
    porting_args.install(pl.Trainer, LightningPortingError)
    assert pl.Trainer.__init__ is init
    # a valid call still builds a Trainer
    assert pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", max_epochs=3).max_epochs == 3


def test_lightning_pytorch_package_too() -> None:
    lightning_pytorch = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.trainer.connectors.accelerator_connector import (
        _AcceleratorConnector as LightningConnector,
    )

    porting_args.install_from_connector(LightningConnector, LightningPortingError)
    with pytest.raises(LightningPortingError, match=r"from lightning\.pytorch\.accelerators import"):
        lightning_pytorch.Trainer(gpus=2, auto_select_gpus=True)

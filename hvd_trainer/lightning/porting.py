"""Lightning 1.x habits of Horovod users, met on Lightning 2.x with a clear outcome.

* ``Trainer()`` (``strategy="auto"``) in a process that Horovod's launcher started
  (``hvdrun`` or ``horovodrun``: ``HOROVOD_RANK`` and ``HOROVOD_SIZE`` are set) uses
  ``strategy="horovod"``, as Lightning 1.x did, and says so on rank 0. Lightning 2.x alone would
  pick a single-device strategy on CPU there (``devices="auto"`` is one CPU device), so every
  rank would train its own model without a word. Under torchrun, mpirun or srun without those
  variables, Lightning's own choice stands (``ddp`` for ``devices > 1``), as Lightning 2.x users
  expect. An explicit ``strategy=`` is never changed.
* A ``Trainer`` that would still train alone in each of the processes Horovod's launcher started
  (an explicit single-device strategy, e.g. ``strategy="single_device"``) says so on rank 0: every
  rank would otherwise fit its own model and write its own checkpoints, without a word.
* ``Trainer(gpus=2)`` and the other arguments Lightning 2.0 removed raise
  :class:`LightningPortingError` with the 2.x spelling (:mod:`hvd_trainer.lightning.porting_args`).
* ``Trainer(accelerator="horovod")`` (Lightning 1.0-1.4) raises :class:`LightningPortingError`
  with the 2.x spelling, instead of Lightning's generic "invalid accelerator name".

They are installed into a Lightning package by :func:`install`, which the strategy's registration
calls (``import hvd_trainer`` is enough; under ``hvdrun`` not even that, see
:mod:`hvd_trainer.launch._horovod_shim`). The auto choice wraps the accelerator connector's
private ``_choose_strategy``, the warning its ``__init__`` (listed in
:mod:`hvd_trainer.lightning._compat`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn

from hvd_trainer.lightning import porting_args, quiet

__all__ = ["LightningPortingError", "HorovodAcceleratorName", "horovod_launched", "install"]

STRATEGY = "horovod"
_WRAPPED = "_hvd_trainer_auto_horovod"


class LightningPortingError(ValueError):
    """A Lightning 1.x spelling that Lightning 2.x does not have; the message gives the 2.x one."""


class HorovodAcceleratorName:
    """Registered as accelerator ``"horovod"`` only to answer Lightning 1.x's spelling.

    Raises:
        LightningPortingError: always, when Lightning builds it (``Trainer(accelerator="horovod")``).
    """

    def __init__(self, **_: Any) -> None:
        raise LightningPortingError(
            "Trainer(accelerator='horovod') is Lightning 1.x's spelling; in Lightning 2.x Horovod-style "
            "training is a strategy. HINT: Trainer(strategy='horovod', accelerator='cpu') "
            "(or accelerator='gpu'), after `import hvd_trainer`; launch with `hvdrun -np N python train.py`."
        )

    @staticmethod
    def is_available() -> bool:
        """False: never offered by Lightning as an available accelerator."""
        return False


def horovod_launched(environ: Mapping[str, str] | None = None) -> bool:
    """Whether Horovod's launcher (``hvdrun``, ``horovodrun``) started this process: the
    ``HOROVOD_RANK`` and ``HOROVOD_SIZE`` variables both set (what Lightning 1.x looked at)."""
    env = os.environ if environ is None else environ
    return "HOROVOD_RANK" in env and "HOROVOD_SIZE" in env


def _auto_horovod(choose: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wrap a connector's ``_choose_strategy(self)``: ``"horovod"`` under Horovod's launcher."""

    @functools.wraps(choose)
    def choose_strategy(self: Any) -> Any:
        if not horovod_launched():
            return choose(self)
        rank_zero_info(
            f"hvd_trainer: Trainer() without strategy= in a job started by hvdrun/horovodrun "
            f"(HOROVOD_SIZE={os.environ['HOROVOD_SIZE']}): using strategy='horovod', as Lightning 1.x "
            "did. HINT: pass strategy='horovod' to say so, or another strategy= to choose it."
        )
        return STRATEGY

    setattr(choose_strategy, _WRAPPED, True)
    return choose_strategy


def _warn_if_alone(init: Callable[..., None], single_device_cls: type) -> Callable[..., None]:
    """Wrap a connector's ``__init__``: a single-device strategy in a job of several processes
    started by Horovod's launcher is named on rank 0 (each rank would train its own model)."""

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 (wraps __init__)
        init(self, *args, **kwargs)
        size = os.environ.get("HOROVOD_SIZE", "1") if horovod_launched() else "1"
        if size.isdigit() and int(size) > 1 and isinstance(self.strategy, single_device_cls):
            rank_zero_warn(
                f"hvd_trainer: this Trainer uses {type(self.strategy).__name__} in a job of {size} "
                "processes started by hvdrun/horovodrun, so every process trains its own model (and "
                "writes its own checkpoints). HINT: Trainer(strategy='horovod') to train one model "
                "on all of them, or leave strategy= out."
            )

    setattr(__init__, _WRAPPED, True)
    return __init__


def install(connector_cls: type, accelerator_registry: Any, single_device_cls: type) -> None:
    """Install the habits above into one Lightning package (idempotent).

    Args:
        connector_cls: that package's ``_AcceleratorConnector`` (its ``_choose_strategy`` and
            ``__init__`` are wrapped).
        accelerator_registry: that package's ``AcceleratorRegistry`` (gets ``"horovod"``).
        single_device_cls: that package's ``SingleDeviceStrategy`` (named when it is chosen).
    """
    quiet.install()
    porting_args.install_from_connector(connector_cls, LightningPortingError)
    choose = connector_cls._choose_strategy
    if not getattr(choose, _WRAPPED, False):
        connector_cls._choose_strategy = _auto_horovod(choose)
    if not getattr(connector_cls.__init__, _WRAPPED, False):
        connector_cls.__init__ = _warn_if_alone(connector_cls.__init__, single_device_cls)
    if STRATEGY not in accelerator_registry:
        accelerator_registry.register(
            STRATEGY, HorovodAcceleratorName,
            description="Lightning 1.x spelling; raises with a HINT to use strategy='horovod'",
        )

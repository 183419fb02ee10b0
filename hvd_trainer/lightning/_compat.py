"""The private Lightning internals hvd_trainer relies on, each one reached only here.

Lightning has no public API for these; they are what its own ``DDPStrategy`` uses, or the
trainer's checkpoint machinery behind ``fit(ckpt_path=...)``. ``tests/unit/test_compat.py``
imports each one and checks the signature or attribute we use against the installed
Lightning, so an upgrade that changes one fails that named test. Versions checked:
pytorch-lightning / lightning-fabric 2.6.

==========================================================  ==================================
private name                                                 used for (by)
==========================================================  ==================================
``pytorch_lightning.strategies.launchers``                   ``python train.py`` with
``._SubprocessScriptLauncher(cluster_environment,            ``devices=N`` starts the other
num_processes, num_nodes)``                                  N-1 processes (strategy)
``lightning_fabric.utilities.optimizer``                     optimizer state onto the root
``._optimizers_to_device(optimizers, device)``               device after setup (strategy)
``Strategy._configure_launcher()`` (overridden),             the strategy-subclass contract:
``Strategy._launcher``, ``ParallelStrategy._layer_sync``     the accelerator connector calls
                                                             the hook and sets ``_layer_sync``
                                                             (``sync_batchnorm=True``)
``trainer._checkpoint_connector``: ``._loaded_checkpoint``,  elastic resume: restore a commit
``._restore_modules_and_callbacks(checkpoint_path)``,        at the start of ``fit`` as
``.dump_checkpoint(weights_only)``                           ``fit(ckpt_path=...)`` would, and
                                                             write a full checkpoint dict
                                                             (lightning/elastic.py)
``pytorch_lightning.trainer.connectors.accelerator_connector  ``Trainer()`` under hvdrun picks
._AcceleratorConnector._choose_strategy(self)``              ``"horovod"`` (lightning/porting.py
                                                             wraps it)
``_AcceleratorConnector.__init__`` and its ``.strategy``     a single-device strategy under
(set by the end of ``__init__``)                             hvdrun is named (porting.py)
``trainer._signal_connector``: ``._sigterm_notifier_fn``     SIGTERM without Lightning's raw
(an instance attribute set before                            broadcast in the handler; a dead
``register_signal_handlers()``), ``.received_sigterm``       peer is named (lightning/signals.py)
``Trainer._teardown()``, ``trainer_fn`` of                   in-process recovery: release a
``Strategy.launcher.launch(trainer_fn, *args, trainer=...)``  failed fit and run it again in the
(called by ``trainer.call._call_and_handle_interrupt``)      same process (lightning/elastic.py)
==========================================================  ==================================

Replaced by public API: ``lightning_fabric.utilities.distributed._all_gather_ddp_if_available``
(the strategy's differentiable ``all_gather`` calls ``torch.distributed.nn.functional.all_gather``,
which is what it wrapped) and ``LightningModule._trainer`` (:func:`attached_trainer` reads the
public ``LightningModule.trainer``).

Importing this module imports Lightning; only the Lightning front end imports it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
from lightning_fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from pytorch_lightning.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher
from pytorch_lightning.trainer.connectors.accelerator_connector import (
    _AcceleratorConnector as AcceleratorConnector,
)

__all__ = [
    "AcceleratorConnector",
    "SubprocessScriptLauncher",
    "attached_trainer",
    "dump_checkpoint",
    "has_loaded_checkpoint",
    "optimizers_to_device",
    "replace_sigterm_notifier",
    "restore_modules_and_callbacks",
    "teardown_failed_run",
]


def attached_trainer(module: pl.LightningModule | None) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to; ``None`` without a module or a trainer.

    ``LightningModule.trainer`` raises ``RuntimeError`` while the module is not attached.
    """
    if module is None:
        return None
    try:
        return module.trainer
    except RuntimeError:
        return None


def has_loaded_checkpoint(trainer: pl.Trainer) -> bool:
    """Whether the trainer already read a checkpoint for this ``fit`` (e.g. ``ckpt_path``)."""
    return bool(trainer._checkpoint_connector._loaded_checkpoint)


def restore_modules_and_callbacks(trainer: pl.Trainer, checkpoint_path: str | os.PathLike[str]) -> None:
    """Load ``checkpoint_path`` through ``trainer.strategy.load_checkpoint`` and restore the
    module, datamodule and callback states, as the start of ``fit(ckpt_path=...)`` does.

    The loops, optimizers and schedulers are restored later by Lightning itself, from the same
    loaded checkpoint (``has_loaded_checkpoint(trainer)`` is True from here on).
    """
    trainer._checkpoint_connector._restore_modules_and_callbacks(str(checkpoint_path))


def dump_checkpoint(trainer: pl.Trainer, *, weights_only: bool = False) -> dict[str, Any]:
    """The checkpoint dict ``trainer.save_checkpoint`` would write (without writing it)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=weights_only)


def replace_sigterm_notifier(trainer: pl.Trainer, notify: Callable[..., None]) -> None:
    """Make ``notify(signum, frame, connector=...)`` the SIGTERM notifier the trainer registers
    at the start of its next run, in place of Lightning's ``_sigterm_notifier_fn`` (which
    broadcasts inside the handler). ``connector.received_sigterm`` is what the loops read."""
    connector = trainer._signal_connector
    connector._sigterm_notifier_fn = functools.partial(notify, connector=connector)


def teardown_failed_run(trainer: pl.Trainer) -> None:
    """Release what a run that raised still holds (the strategy's setup, the loops' data
    fetchers, loggers' connector, signal handlers), as Lightning's own error path does after a
    failed ``fit``, without calling the ``on_exception`` hooks: the caller runs it again."""
    trainer._teardown()
    trainer.state.stage = None  # as Lightning resets it after its teardown

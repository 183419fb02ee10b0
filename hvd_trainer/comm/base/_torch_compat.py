"""The private torch internals hvd_trainer relies on, each one reached only here.

It sits in comm, the lowest layer that needs one, and imports nothing of hvd_trainer, so every
layer can use it. ``tests/unit/test_compat.py`` checks each entry against the installed torch
(checked: torch 2.13), so an upgrade that changes one fails that named test.

=======================================================  =========================================
private name                                              used for (by)
=======================================================  =========================================
``torch.distributed.distributed_c10d                      the key-value store of a default process
._get_default_store()``                                   group that an engine (Ray Train, Spark)
                                                          created before us (comm runtime)
``torch.nn.modules.batchnorm._BatchNorm``                 the base class of every BatchNorm layer,
                                                          what ``convert_sync_batchnorm`` replaces
                                                          (as torch's own does; torch/sync_batchnorm)
``Optimizer._step_supports_amp_scaling``                  ``GradScaler.step`` reads it; the torch
                                                          ``DistributedOptimizer`` pins it to False
                                                          so a fused inner optimizer's True is not
                                                          inherited (torch/optimizer.py)
=======================================================  =========================================

Replaced by public API: the ``DistributedOptimizer``'s step and state-dict hook tables are made
by ``Optimizer.__setstate__`` (:func:`init_optimizer_bookkeeping`) instead of re-creating
``Optimizer``'s six private ``_optimizer_*_hooks`` dicts and calling ``_patch_step_function``;
``SyncBatchNorm`` checks its input itself instead of calling ``_check_input_dim`` and
``_check_non_zero_input_channels``; hvdrun's loopback rendezvous implements the public
``RendezvousHandler`` instead of subclassing ``StaticTCPRendezvous`` and setting its ``_store``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["AMP_SCALING_FLAG", "BatchNormBase", "default_store", "init_optimizer_bookkeeping"]

BatchNormBase: type[torch.nn.Module] = torch.nn.modules.batchnorm._BatchNorm
"""Base class of ``BatchNorm1d/2d/3d``, their lazy forms and ``SyncBatchNorm``."""

AMP_SCALING_FLAG = "_step_supports_amp_scaling"
"""Optimizer attribute ``torch.amp.GradScaler.step`` reads: True hands the scale to the
optimizer's own ``step`` instead of unscaling the gradients in ``param_groups`` first."""


def default_store() -> dist.Store:
    """The key-value store of the default process group.

    Raises:
        ValueError: ``torch.distributed`` is not initialised (torch's own error).
    """
    return dist.distributed_c10d._get_default_store()


def init_optimizer_bookkeeping(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer``, whose ``__init__`` did not run ``torch.optim.Optimizer.__init__``
    (a wrapper whose parameters, state and defaults are another optimizer's), the bookkeeping
    that ``__init__`` creates: the step and state-dict hook tables behind the public
    ``register_step_pre_hook`` and friends, and the profiled, hook-running ``step``.

    ``Optimizer.__setstate__`` (the public unpickling hook) creates exactly these when they are
    missing; it also adds ``differentiable`` to ``defaults``, which is undone here so that the
    wrapped optimizer's ``defaults`` stay as they were.
    """
    defaults = optimizer.defaults
    before = set(defaults)
    torch.optim.Optimizer.__setstate__(optimizer, {})
    for key in set(defaults) - before:
        del defaults[key]

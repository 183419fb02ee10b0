"""Lightning plugins of hvd_trainer (imported only when Lightning is used)."""

from __future__ import annotations

import torch
from pytorch_lightning.plugins import TorchSyncBatchNorm
from typing_extensions import override

from hvd_trainer.torch.sync_batchnorm import SyncBatchNorm

__all__ = ["HorovodSyncBatchNorm"]


class HorovodSyncBatchNorm(TorchSyncBatchNorm):
    """Lightning ``LayerSync`` plugin that converts BatchNorm layers to our
    :class:`~hvd_trainer.torch.sync_batchnorm.SyncBatchNorm` (CPU and CUDA). ``revert`` is
    Lightning's (ours subclasses ``torch.nn.SyncBatchNorm``)."""

    @override
    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        return SyncBatchNorm.convert_sync_batchnorm(model)

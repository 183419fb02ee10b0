"""``horovod.torch.elastic``'s module path: :mod:`hvd_trainer.elastic` (``run``, ``TorchState``,
``ObjectState``, ``ElasticSampler``, ...) under Horovod's import path, so
``import hvd_trainer.torch as hvd`` offers ``hvd.elastic.run`` as ``horovod.torch`` does.
Nothing is defined here."""

from __future__ import annotations

from hvd_trainer import elastic as _elastic
from hvd_trainer.elastic import *  # noqa: F403 - the module is a re-export of elastic's public names

__all__ = list(_elastic.__all__)

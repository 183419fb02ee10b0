"""Elastic training on torchrun's elastic agent: commit, restore, sync, resume mid-epoch.

``hvdrun --min-np N --max-np M`` (or ``--max-restarts R``) restarts all workers after a
failure; :func:`run` reloads the last commit and syncs it from the new rank 0.
"""

from __future__ import annotations

from hvd_trainer.elastic.keras_state import KerasState
from hvd_trainer.elastic.persist import PersistError
from hvd_trainer.elastic.run import default_checkpoint_dir, run
from hvd_trainer.elastic.sampler import ElasticSampler
from hvd_trainer.elastic.state import STATE_FILENAME, ObjectState, State, TorchState

__all__ = [
    "State", "ObjectState", "TorchState", "KerasState", "ElasticSampler", "run",
    "default_checkpoint_dir", "STATE_FILENAME", "PersistError",
]

"""``horovod.torch.functions``'s module path: parameter, optimizer-state and object broadcast
under Horovod's import path. Nothing is defined here."""

from __future__ import annotations

from hvd_trainer.comm import allgather_object, broadcast_object
from hvd_trainer.torch.state_sync import broadcast_optimizer_state, broadcast_parameters

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]

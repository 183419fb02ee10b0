"""Argument checks shared by the collectives (before any process group is touched)."""

from __future__ import annotations

from typing import Any

import torch

from hvd_trainer.comm.base.errors import CommTypeError

__all__ = ["require_tensor"]


def require_tensor(tensor: Any, fn: str) -> torch.Tensor:
    """Return ``tensor`` if it is a ``torch.Tensor``.

    Raises:
        CommTypeError: it is not, naming the collective ``fn`` and the type received.
    """
    if not isinstance(tensor, torch.Tensor):
        raise CommTypeError(f"{fn} expects a torch.Tensor, got {type(tensor).__name__}.")
    return tensor

"""This process's global random-number generator states: capture and restore.

An elastic commit stores every rank's states so that a resumed run draws the same random
numbers (dropout masks, random samplers, augmentation) as an uninterrupted one.

Captured: torch's CPU generator (``torch.get_rng_state()``, a ``uint8`` tensor of 5056 bytes),
the CUDA generators of every visible device (``torch.cuda.get_rng_state_all()``, 16 bytes each,
only when this process already initialised CUDA, so a CPU job never creates a CUDA context),
numpy's legacy global generator (``np.random.get_state()``) and Python's ``random``
(``random.getstate()``). About 12 KB pickled per process.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng_states", "restore_rng_states"]


def capture_rng_states() -> dict[str, Any]:
    """``{"torch", "cuda", "numpy", "python"}`` states of this process (``cuda``: a list, empty
    when CUDA is not initialised here; ``numpy``: its state tuple with the key as an ``int64``
    tensor). Only tensors and plain Python values, so ``torch.load(weights_only=True)`` (what
    ``fit(ckpt_path=...)`` uses) reads a checkpoint that holds them."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    name, key, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (str(name), torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    return {"torch": torch.get_rng_state(), "cuda": cuda, "numpy": numpy_state, "python": random.getstate()}


def restore_rng_states(states: dict[str, Any]) -> None:
    """Set this process's generators to ``states`` (from :func:`capture_rng_states`).

    CUDA states are restored only when there were some and this process sees as many devices
    (a CPU-only restart skips them).
    """
    torch.set_rng_state(states["torch"])
    name, key, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(states["python"])
    cuda = states["cuda"]
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)

"""A local stand-in for the MNIST download of Horovod's examples: same shapes and dtypes.

``mnist(n, seed)`` returns ``(images, labels)``: float32 ``[n, 1, 28, 28]`` normalised like
torchvision's ``Normalize((0.1307,), (0.3081,))`` and int64 labels in ``0..9``. Each label has
its own bright 7x7 patch, so a small network learns the task in a few steps (a falling loss is
then a real signal, not noise). ``report(name, **values)`` writes this rank's results as JSON
to ``$EXAMPLE_OUT/<name>.<rank>.json`` for the test to read (stdout lines of ranks may mix).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

__all__ = ["mnist", "report"]


def mnist(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n).astype(np.int64)
    images = rng.uniform(0.0, 0.3, size=(n, 1, 28, 28)).astype(np.float32)
    for i, label in enumerate(labels):
        row, col = divmod(int(label), 4)
        images[i, 0, 2 + 7 * row: 9 + 7 * row, 2 + 6 * col: 9 + 6 * col] = 1.0
    return (images - 0.1307) / 0.3081, labels


def report(name: str, rank: int, **values: Any) -> None:
    path = os.path.join(os.environ["EXAMPLE_OUT"], f"{name}.{rank}.json")
    with open(path, "w") as f:
        json.dump(values, f)

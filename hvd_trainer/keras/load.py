"""``load_model``: load a saved Keras model with its optimizer wrapped for distributed training."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import keras

from hvd_trainer.keras.optimizer import DistributedOptimizer

__all__ = ["load_model"]


def load_model(
    filepath: str | os.PathLike[str],
    custom_optimizers: Sequence[type] | None = None,
    custom_objects: dict[str, Any] | None = None,
    compression: Any = None,
    **optimizer_kwargs: Any,
) -> keras.Model:
    """``keras.models.load_model`` whose compiled optimizer comes back as a DistributedOptimizer.

    As Horovod's ``load_model``: every rank loads the same file, so weights and optimizer state
    (``iterations``, slots such as momentum) are equal everywhere and training resumes where the
    saved run stopped. A model saved without an optimizer (or with ``compile=False`` semantics)
    is returned as loaded.

    Args:
        filepath: a ``.keras`` (or other Keras-loadable) file.
        custom_optimizers: optimizer classes the file may name besides Keras' own (registered
            under their class names).
        custom_objects: further custom layers/losses/metrics, as for ``keras.models.load_model``.
        compression: wire compression for the wrapped optimizer (e.g. ``Compression.fp16``).
        **optimizer_kwargs: passed to :class:`DistributedOptimizer` (``backward_passes_per_step``,
            ``op``, ``gradient_predivide_factor``, ...).

    Returns:
        The loaded ``keras.Model``; ``model.optimizer`` wraps the loaded optimizer.

    Raises:
        FileNotFoundError: ``filepath`` does not exist (checked before Keras is asked).
        ValueError/TypeError: as ``keras.models.load_model`` (unknown custom objects, ...).
    """
    if not os.path.exists(filepath):
        raise FileNotFoundError(
            f"load_model: no model file at {os.fspath(filepath)!r}. HINT: check the path; every rank "
            "must see the file (a shared file system, or save it on every node)."
        )
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    inner = getattr(model, "optimizer", None)
    if inner is None or isinstance(inner, DistributedOptimizer):
        return model
    model.optimizer = DistributedOptimizer(inner, compression=compression, **optimizer_kwargs)
    model.make_train_function(force=True)
    return model

"""``PartialDistributedOptimizer``: a ``DistributedOptimizer`` whose given layers train locally."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras

from hvd_trainer.comm import World
from hvd_trainer.keras.optimizer import DistributedOptimizer

__all__ = ["PartialDistributedOptimizer"]


def PartialDistributedOptimizer(  # noqa: N802, PLR0913 - Horovod's name and signature
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = None,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: Any = None,
    process_set: Any = None,
    local_layers: keras.layers.Layer | Iterable[keras.layers.Layer] | None = None,
    scale_local_gradients: bool = True,
    *,
    world: World | None = None,
) -> DistributedOptimizer:
    """A :class:`~hvd_trainer.keras.DistributedOptimizer` that does not reduce the gradients of
    ``local_layers`` (Horovod's ``PartialDistributedOptimizer``, for model-parallel layers or
    per-rank heads).

    Every trainable weight of each local layer is registered with
    :meth:`~hvd_trainer.keras.DistributedOptimizer.register_local_var`: each rank applies its
    own gradient for it, divided by the world size when ``scale_local_gradients`` (Horovod's
    default). All other gradients are averaged as usual. To also keep those layers' initial
    values per rank, pass the same weights to
    ``BroadcastGlobalVariablesCallback(0, local_variables=...)``.

    Example:
        >>> head = model.layers[-1]
        >>> opt = PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[head])

    Args:
        local_layers: one ``keras.layers.Layer`` or an iterable of them (``None``: none, then
            this is a plain ``DistributedOptimizer``).
        the others: as :class:`~hvd_trainer.keras.DistributedOptimizer` (same order, without
            the deprecated ``num_groups``).

    Returns:
        The ``DistributedOptimizer``, its local variables registered.

    Raises:
        TypeError: an entry of ``local_layers`` is not a Keras layer.
        DistributedOptimizerError: as ``DistributedOptimizer``.
    """
    opt = DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
        0, groups, process_set, scale_local_gradients, world=world,
    )
    if isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    for layer in local_layers or ():
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                f"local_layers must be keras.layers.Layer instances, got {type(layer).__name__} "
                f"({layer!r}). HINT: local_layers=[model.get_layer('head')]."
            )
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt

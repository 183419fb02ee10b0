"""Make model weights and optimizer variables equal on every rank when training starts."""

from __future__ import annotations

import warnings

import keras
import numpy as np

from hvd_trainer.comm import get_world
from hvd_trainer.keras import _bridge
from hvd_trainer.keras.optimizer import DistributedOptimizer, DistributedOptimizerError

__all__ = ["BroadcastGlobalVariablesCallback", "broadcast_variables"]


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Assign ``root_rank``'s values to ``variables`` (Keras variables) on every rank.

    One broadcast per dtype. Every rank must pass the same variables in the same order.
    """
    variables = list(variables)
    world = get_world()
    if world.size == 1 or not variables:
        return
    values = [np.asarray(keras.ops.convert_to_numpy(v.value)) for v in variables]
    received = _bridge.broadcast_arrays(values, root_rank=root_rank, world=world)
    if world.rank != root_rank:
        for v, value in zip(variables, received, strict=True):
            v.assign(value)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast ``model.weights`` and the optimizer's variables from ``root_rank``.

    At ``on_train_begin`` if the model is built (the optimizer is built here if it is not yet),
    so every rank starts the first update from the same state. On the TensorFlow backend a
    subclassed model is built only when the first step is traced; then the broadcast happens
    after batch 0 instead (Horovod's behaviour), and from there on all ranks are identical.

    ``local_variables`` (Horovod's argument) are left out of the broadcast: each rank keeps its
    own value (model-parallel or per-rank state, e.g. the layers given to
    :func:`~hvd_trainer.keras.PartialDistributedOptimizer`). More can be added with
    :meth:`register_local_var` before ``fit``. With a ZeRO-sharded ``DistributedOptimizer``
    (``zero_stage=1|2``) only its ``iterations`` and learning rate are broadcast: each rank's
    slot variables are its own shard (``DistributedOptimizer.replicated_variables``).

    It also switches ``jit_compile`` off (with a warning) on TensorFlow when the model's
    optimizer is a :class:`DistributedOptimizer`, because XLA cannot run the allreduce bridge,
    and it rejects a ``LossScaleOptimizer`` *around* a ``DistributedOptimizer`` (hang hazard).

    Example:
        >>> model.fit(x, y, callbacks=[BroadcastGlobalVariablesCallback(root_rank=0)])
        >>> BroadcastGlobalVariablesCallback(0, local_variables=model.layers[-1].weights)

    Args:
        root_rank: the rank whose values everyone receives.
        device: accepted for Horovod's signature; unused (the broadcast goes through the comm
            layer's host path, whatever device the variables live on).
        local_variables: one ``keras.Variable`` or an iterable of them, not broadcast.

    Raises:
        TypeError: an entry of ``local_variables`` is not a ``keras.Variable``.
        DistributedOptimizerError: ``LossScaleOptimizer(DistributedOptimizer(...))``.
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self.local_variables: list = []
        if isinstance(local_variables, keras.Variable):
            local_variables = [local_variables]
        for var in local_variables or ():
            self.register_local_var(var)

    def register_local_var(self, var) -> None:
        """Keep ``var`` (a ``keras.Variable``) out of the broadcast.

        Raises:
            TypeError: ``var`` is not a ``keras.Variable``.
        """
        if not isinstance(var, keras.Variable):
            raise TypeError(
                f"local_variables must be keras.Variable instances, got {type(var).__name__} "
                f"({var!r}). HINT: pass layer.weights (or layer.trainable_weights)."
            )
        if not any(var is v for v in self.local_variables):
            self.local_variables.append(var)

    def on_train_begin(self, logs=None) -> None:
        _check_optimizer_nesting(self.model.optimizer)
        _disable_xla(self.model)
        self.broadcast_done = False
        if self.model.built:
            opt = self.model.optimizer
            if opt is not None and not opt.built:
                opt.build(self.model.trainable_variables)
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None) -> None:
        if not self.broadcast_done:
            self._broadcast()

    def _broadcast(self) -> None:
        opt = self.model.optimizer
        variables = list(self.model.weights)
        if opt is not None and opt.built:
            # a ZeRO-sharded DistributedOptimizer: its slots are each rank's own shard
            variables += list(getattr(opt, "replicated_variables", opt.variables))
        local = {id(v) for v in self.local_variables}
        broadcast_variables([v for v in variables if id(v) not in local], self.root_rank)
        self.broadcast_done = True


def _check_optimizer_nesting(opt) -> None:
    inner = getattr(opt, "inner_optimizer", None)
    if type(opt) is keras.optimizers.LossScaleOptimizer and type(inner) is DistributedOptimizer:
        raise DistributedOptimizerError(
            "the model's optimizer is LossScaleOptimizer(DistributedOptimizer(...)): a rank "
            "with inf/NaN gradients would skip its allreduce and hang the others. HINT: "
            "DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt)), or create the "
            "DistributedOptimizer after keras.mixed_precision.set_global_policy('mixed_float16')."
        )


def _disable_xla(model) -> None:
    if keras.backend.backend() != "tensorflow" or type(model.optimizer) is not DistributedOptimizer:
        return
    if model.jit_compile:
        warnings.warn(
            "jit_compile=True is not supported with DistributedOptimizer on TensorFlow (XLA "
            "cannot run the allreduce bridge); training with jit_compile=False.",
            stacklevel=3,
        )
        model.jit_compile = False
        model.make_train_function(force=True)

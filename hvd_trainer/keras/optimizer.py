"""``DistributedOptimizer``: averages gradients over ranks before a Keras 3 optimizer applies them.

It composes an inner optimizer (the pattern of Keras' own ``LossScaleOptimizer``) and
overrides ``apply()``, the one method every backend's ``train_step`` reaches, so gradients are
reduced before the inner optimizer's unscaling, clipping, weight decay and update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from hvd_trainer.comm import (
    Compression,
    Compressor,
    GradientReducer,
    ReduceOp,
    World,
    get_world,
    grouped_allreduce_,
)
from hvd_trainer.comm.optimizer_args import OptimizerArgumentError, check_optimizer_args
from hvd_trainer.keras import _accumulate, _bridge
from hvd_trainer.keras._compat import built_trainable_variables, in_xla_context

__all__ = ["DistributedOptimizer", "DistributedOptimizerError"]

_LSO = keras.optimizers.LossScaleOptimizer


class DistributedOptimizerError(OptimizerArgumentError):
    """Invalid ``DistributedOptimizer`` arguments or an unsupported setup (a ``ValueError``)."""


class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wrap ``optimizer`` so that it applies the gradient averaged over all ranks.

    TensorFlow backend: inside ``tf.function`` the gradients go through ``tf.numpy_function``
    to one fused comm allreduce per dtype (XLA cannot run that op, so a model compiled with
    ``jit_compile=True`` is switched to ``False`` with a warning by
    :class:`~hvd_trainer.keras.callbacks.BroadcastGlobalVariablesCallback`; without it the
    trace fails with a HINT). torch backend: the comm layer's hook-driven bucket reducer starts
    allreduces while ``loss.backward()`` runs; ``apply()`` waits for them.

    Gradient accumulation (``backward_passes_per_step=N > 1``, Horovod's semantics): every
    ``apply()`` call adds the local gradients into local accumulators (one per trainable
    variable, same shape and dtype). Only every N-th call reduces the sums over ranks (one
    fused allreduce per dtype; also divided by N when ``average_aggregated_gradients``, folded
    into the allreduce's post-scale factor), hands
    them to the inner optimizer and zeroes the accumulators. The other N-1 calls communicate
    nothing and change no model or optimizer-slot variable, but ``iterations`` still advances
    by one on every call, as in Horovod (so ``iterations`` counts batches, and LR schedules and
    callbacks keyed on it stay per batch). With ``op=Average`` the applied gradient is
    ``sum over passes of (mean over ranks)``, i.e. ``N`` times the mean gradient of the
    ``N * size`` micro-batches, or exactly that mean with ``average_aggregated_gradients=True``.
    On TensorFlow the accumulators are ``tf.Variable`` s and the update is a ``tf.cond`` (the
    allreduce runs only in its true branch); on torch the hook reducer is not used and the
    update step does one grouped comm allreduce. The window counter runs across epochs and
    ``steps_per_execution`` (each train step is one pass): with a number of batches not
    divisible by N the leftover gradients stay in the accumulators and join the first update
    of the next epoch (Horovod does the same). Accumulators and counter are never saved: a
    partially filled window restarts empty after loading. With a ``LossScaleOptimizer`` the
    accumulated gradients are scaled ones (the scale only changes on update steps) and a
    non-finite pass makes the whole window's update be skipped on every rank (that call then
    does not advance ``iterations``, as any skipped step in Keras). On torch a variable that
    got no gradient on any rank during the window is passed to the inner optimizer as ``None``.

    Mixed precision: the optimizer must sit *outside* the ``LossScaleOptimizer`` so every rank
    sees the same reduced gradients and takes the same inf/NaN skip decision (a rank that
    skipped its allreduce would otherwise hang the others). When the global dtype policy is
    ``mixed_float16`` and ``optimizer`` is not a ``LossScaleOptimizer``, it is wrapped in one
    here, exactly as ``model.compile`` would have done.

    Saving: the wrapper reports the inner optimizer's class and config (``__class__``,
    ``get_config``) and stores exactly the inner optimizer's variables, so a model saved with
    it names a plain Keras optimizer and loads with Keras alone.

    Example:
        >>> import hvd_trainer, hvd_trainer.keras as hvd_keras
        >>> hvd_trainer.init()
        >>> opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd_trainer.size()))
        >>> model.compile(optimizer=opt, loss="mse")
        >>> model.fit(x, y, callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])

    Args:
        optimizer: the Keras optimizer to wrap (not modified, except that a
            ``LossScaleOptimizer`` owns it under ``mixed_float16``).
        name: optional name (default ``"distributed_<inner name>"``).
        compression: wire format of floating gradients: ``None``/``Compression.none``,
            ``Compression.fp16`` or ``Compression.bf16`` (a compressor instance or class from
            :mod:`hvd_trainer.keras.compression`, or the strings ``"none"``/``"fp16"``/``"bf16"``;
            see :meth:`~hvd_trainer.comm.compression.Compression.resolve`); both backends.
        backward_passes_per_step: N >= 1, ``apply()`` calls per update (see above).
        average_aggregated_gradients: with N > 1, divide the accumulated sum by N (default
            False, as in Horovod).
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: with ``Average``, multiply by ``1/f`` before the sum and by
            ``f/size`` after it (same result, different rounding). Must be > 0.
        world: the world to reduce over (default: the initialised one, looked up on first use).

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer, or an unknown keyword argument.
        DistributedOptimizerError: unsupported ``op``, ``compression`` or factor, or
            ``backward_passes_per_step`` not an int >= 1 (``True`` included).
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer,
        name: str | None = None,
        compression: Compressor | type[Compressor] | str | None = None,
        backward_passes_per_step: int = 1,
        op: ReduceOp | str | None = None,
        gradient_predivide_factor: float = 1.0,
        average_aggregated_gradients: bool = False,
        *,
        world: World | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(
                f"DistributedOptimizer got unexpected keyword argument(s) {sorted(kwargs)}. "
                "HINT: set learning_rate, clipnorm, weight_decay, ... on the inner optimizer."
            )
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                f"optimizer must be a keras.optimizers.Optimizer instance, got "
                f"{type(optimizer).__name__} ({optimizer!r}). HINT: keras.optimizers.SGD(0.01)."
            )
        if isinstance(optimizer, DistributedOptimizer):
            raise DistributedOptimizerError(
                "optimizer is already a DistributedOptimizer; wrapping it twice would reduce "
                "gradients twice. HINT: wrap the plain Keras optimizer once."
            )
        args = check_optimizer_args(
            op, backward_passes_per_step, gradient_predivide_factor, error=DistributedOptimizerError
        )
        compressor = Compression.resolve(compression, error=DistributedOptimizerError)
        if _global_policy_is_mixed_float16() and not isinstance(optimizer, _LSO):
            # Keras' compile() would wrap us in a LossScaleOptimizer; its local finiteness test
            # would then skip our allreduce on one rank only. Own the LSO instead.
            optimizer = _LSO(optimizer)
        super().__init__(learning_rate=0.0, name=name or f"distributed_{optimizer.name}")
        self.inner_optimizer = optimizer
        self._op = args.op
        self._compression = compressor
        self._passes = args.backward_passes_per_step
        self._average_passes = bool(average_aggregated_gradients)
        self._accum: Any = None  # _accumulate.TFAccumulation / TorchAccumulation when N > 1
        self._predivide = args.gradient_predivide_factor
        self._world = world
        self._reducer = None
        self._buffers = _bridge.FlatBuffers()
        self._tf = keras.backend.backend() == "tensorflow"
        if keras.backend.backend() not in ("tensorflow", "torch"):
            raise DistributedOptimizerError(
                f"DistributedOptimizer supports the tensorflow and torch backends, got "
                f"KERAS_BACKEND={keras.backend.backend()!r}. HINT: set KERAS_BACKEND=torch or "
                "tensorflow before importing keras."
            )

    # -- identity: saved models name the inner optimizer ----------------------------------
    @property
    def __class__(self):  # see the class docstring ("Saving")
        return type(self.__dict__.get("inner_optimizer", self))

    def get_config(self) -> dict[str, Any]:
        return self.inner_optimizer.get_config()

    # -- delegation -------------------------------------------------------------------------
    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def variables(self):
        return self.inner_optimizer.variables

    def save_own_variables(self, store) -> None:
        self.inner_optimizer.save_own_variables(store)

    def load_own_variables(self, store) -> None:
        self.inner_optimizer.load_own_variables(store)

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise DistributedOptimizerError(
            "DistributedOptimizer has no stateless_apply (the JAX path). HINT: use "
            "KERAS_BACKEND=torch or tensorflow, or keras.distribution.DataParallel on JAX."
        )

    # -- the work ---------------------------------------------------------------------------
    @property
    def world(self) -> World:
        """The world gradients are reduced over (resolved on first use)."""
        if self._world is None:
            self._world = get_world()
        return self._world

    def build(self, var_list: Sequence[Any]) -> None:
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        if self._passes > 1:
            kind = _accumulate.TFAccumulation if self._tf else _accumulate.TorchAccumulation
            self._accum = kind(list(var_list), self._passes)
        elif not self._tf and self.world.size > 1:
            self._build_torch_reducer(var_list)

    def _build_torch_reducer(self, var_list: Sequence[Any]) -> None:
        named = [(f"{i}:{v.path}", v.value) for i, v in enumerate(var_list) if v.trainable]
        op, pre, post = self._scales()
        self._reducer = GradientReducer(named, world=self.world, op=op, compression=self._compression,
                                        prescale_factor=pre, postscale_factor=post)

    def apply(self, grads, trainable_variables=None):
        if not self.built and trainable_variables is not None:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if self._passes > 1:
            self._apply_accumulated(grads, trainable_variables)
            return
        if self.world.size > 1:
            grads = self._reduce_tf(grads) if self._tf else self._reduce_torch(grads, trainable_variables)
        self.inner_optimizer.apply(grads, trainable_variables)

    def _apply_accumulated(self, grads, trainable_variables) -> None:
        """N > 1: accumulate; on the N-th call reduce the sums and apply them (class docstring)."""
        tvs = built_trainable_variables(self) if trainable_variables is None else list(trainable_variables)
        counter = _accumulate.iteration_variable(self.inner_optimizer)
        if self._tf:
            def update(summed):
                if self.world.size > 1:
                    summed = self._reduce_tf(summed, passes=self._passes)
                elif self._average_passes:
                    summed = [None if g is None else g / self._passes for g in summed]
                self.inner_optimizer.apply(summed, tvs)

            def accumulate():
                counter.assign_add(1)

            self._accum.step(grads, update, accumulate)
            return
        if not self._accum.add(grads):
            counter.assign_add(1)
            return
        try:
            self.inner_optimizer.apply(self._reduce_torch_sums(), tvs)
        finally:
            self._accum.reset()

    def _reduce_torch_sums(self) -> list[Any]:
        """Reduce the accumulators in place (one grouped allreduce); None where no rank had a gradient."""
        acc = self._accum
        if self.world.size > 1:
            op, pre, post = self._scales(passes=self._passes)
            grouped_allreduce_([*acc.sums, acc.used], op=op, name="keras.accumulated_gradients",
                               prescale_factor=pre, postscale_factor=post,
                               compression=self._compression, world=self.world)
        elif self._average_passes:
            for s in acc.sums:
                s.div_(self._passes)
        used = acc.used.tolist()
        return [s if u > 0 else None for s, u in zip(acc.sums, used, strict=True)]

    def _scales(self, passes: int = 1) -> tuple[ReduceOp, float, float]:
        """(op, prescale, postscale) for the allreduce: predivide factor and the 1/N of
        ``average_aggregated_gradients`` folded into the factors."""
        op, pre, post = self._op, 1.0, 1.0
        if op is ReduceOp.AVERAGE and self._predivide != 1.0:
            op, pre, post = ReduceOp.SUM, 1.0 / self._predivide, self._predivide / self.world.size
        if passes > 1 and self._average_passes:
            post /= passes
        return op, pre, post

    def _reduce_torch(self, grads, trainable_variables):
        assert self._reducer is not None
        self._reducer.wait()
        tvs = trainable_variables if trainable_variables is not None else built_trainable_variables(self)
        # wait() may have given an unused parameter a (zero, then averaged) gradient.
        return [v.value.grad if v.trainable else g for g, v in zip(grads, tvs, strict=True)]

    def _reduce_tf(self, grads, passes: int = 1):
        import tensorflow as tf

        if in_xla_context():
            raise DistributedOptimizerError(
                "DistributedOptimizer cannot run inside an XLA-compiled function "
                "(jit_compile=True): its allreduce leaves the graph. HINT: "
                "model.compile(..., jit_compile=False), or add "
                "BroadcastGlobalVariablesCallback, which switches it off with a warning."
            )
        idx = [i for i, g in enumerate(grads) if g is not None]
        dense = [tf.convert_to_tensor(grads[i]) for i in idx]
        if not dense:
            return grads
        reduce = self._reduce_numpy if passes == 1 else self._reduce_numpy_accumulated
        reduced = tf.numpy_function(
            reduce, dense, Tout=[g.dtype for g in dense], stateful=True,
            name="hvd_allreduce",
        )
        out = list(grads)
        for i, g, r in zip(idx, dense, reduced, strict=True):
            out[i] = tf.ensure_shape(r, g.shape)
        return out

    def _reduce_numpy(self, *arrays, passes: int = 1):
        op, pre, post = self._scales(passes)
        return _bridge.allreduce_arrays(
            arrays, world=self.world, op=op, prescale_factor=pre, postscale_factor=post,
            compression=self._compression, buffers=self._buffers,
        )

    def _reduce_numpy_accumulated(self, *arrays):
        return self._reduce_numpy(*arrays, passes=self._passes)


def _global_policy_is_mixed_float16() -> bool:
    return keras.config.dtype_policy().name == "mixed_float16"

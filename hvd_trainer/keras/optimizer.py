"""``DistributedOptimizer``: averages gradients over ranks before a Keras 3 optimizer applies them.

It composes an inner optimizer (the pattern of Keras' own ``LossScaleOptimizer``) and
overrides ``apply()``, the one method every backend's ``train_step`` reaches, so gradients are
reduced before the inner optimizer's unscaling, clipping, weight decay and update.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from hvd_trainer.comm import (
    Compressor,
    FeedbackState,
    GradientReducer,
    GradientSync,
    OptimizerArgumentError,
    ReduceOp,
    ShardedGradientReducer,
    SyncOptions,
    World,
    grouped_allreduce_,
    in_process_recovery,
    reduce_with_feedback,
    rename_feedback,
    resolve_set,
)
from hvd_trainer.keras import _accumulate, _bridge
from hvd_trainer.keras._compat import built_trainable_variables, in_xla_context
from hvd_trainer.keras._zero import KerasZero, replicated

__all__ = ["DistributedOptimizer", "DistributedOptimizerError"]

_LSO = keras.optimizers.LossScaleOptimizer


class DistributedOptimizerError(OptimizerArgumentError):
    """Invalid ``DistributedOptimizer`` arguments or an unsupported setup (a ``ValueError``)."""


class _LocalVariables:
    """Variables registered as local, in order (a plain object, so Keras does not track them)."""

    def __init__(self) -> None:
        self.variables: list[Any] = []
        self._ids: set[int] = set()

    def add(self, var: Any) -> bool:
        """Register ``var``; False if it already was."""
        if id(var) in self._ids:
            return False
        self.variables.append(var)
        self._ids.add(id(var))
        return True

    def contains(self, var: Any) -> bool:
        return id(var) in self._ids


class _FromConfig:
    """``from_config`` for both call forms Keras code uses.

    On an instance (``opt.from_config(cfg)``, Horovod's round trip): a new wrapper with the same
    options around ``type(inner).from_config(cfg)``. On the class: ``cfg`` must be a serialized
    optimizer (``keras.optimizers.serialize(opt)``: ``class_name`` + ``config``), since the inner
    config alone does not name its class.
    """

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is not None:
            return instance._rebuild
        return _class_from_config


def _class_from_config(config: dict[str, Any], custom_objects: dict[str, Any] | None = None):
    if not (isinstance(config, dict) and "class_name" in config and "config" in config):
        raise DistributedOptimizerError(
            "DistributedOptimizer.from_config(config) on the class needs a serialized optimizer "
            "({'class_name': ..., 'config': ...}); a bare optimizer config does not say which "
            "optimizer to build. HINT: opt.from_config(opt.get_config()) on an instance, or "
            "DistributedOptimizer.from_config(keras.optimizers.serialize(inner))."
        )
    return DistributedOptimizer(keras.optimizers.deserialize(config, custom_objects=custom_objects))


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

    Error feedback (``compression="int8"`` or ``"powersgd:R"``): the comm layer's bucket
    reductions (:mod:`hvd_trainer.comm.reduce.compressed`) with a residual per variable (and
    PowerSGD's warm-start ``Q``), keyed ``"<index>:<variable path>"``. On torch the hook reducer
    runs them on its buckets while backward runs; on TensorFlow, and with
    ``backward_passes_per_step > 1`` on both backends (once per window, on the sums), the
    gradients are reduced by :func:`~hvd_trainer.comm.reduce.compressed.reduce_with_feedback`
    (one bucket per dtype). The state is this rank's training state and is not in Keras' saved
    model: :meth:`compression_state_dict` / :meth:`load_compression_state_dict` carry it, and a
    resume with both (and the model and optimizer variables) is bit-identical.

    Mixed precision: the optimizer must sit *outside* the ``LossScaleOptimizer`` so every rank
    sees the same reduced gradients and takes the same inf/NaN skip decision (a rank that
    skipped its allreduce would otherwise hang the others). When the global dtype policy is
    ``mixed_float16`` and ``optimizer`` is not a ``LossScaleOptimizer``, it is wrapped in one
    here, exactly as ``model.compile`` would have done.

    Saving: the wrapper reports the inner optimizer's class and config (``__class__``,
    ``get_config``) and stores exactly the inner optimizer's variables, so a model saved with
    it names a plain Keras optimizer and loads with Keras alone.

    ZeRO (``zero_stage=1|2``, torch backend; Rajbhandari et al. 2020): the plan and the
    parameter exchange are the comm layer's (:mod:`hvd_trainer.comm.zero`), run on the torch
    tensors behind the Keras variables. Per update every rank calls the inner optimizer's
    ``apply`` on its owned variables (``iterations`` advances on every rank, also one owning
    nothing) and then takes part in the exchange (an allgather per balanced bucket, else one
    broadcast per owner). Local variables (:meth:`register_local_var`, before ``build``) are
    not sharded: each rank steps its own. Stage 1 works with ``backward_passes_per_step > 1``
    (the window's sums are allreduced, then the owned variables stepped). Checkpoints: each
    rank's ``variables`` are its shard, so saving is refused (``save_own_variables`` and hence
    ``model.save`` raise :class:`DistributedOptimizerError`) unless :meth:`consolidate_variables`
    ran on every rank since the last step; rank ``to`` then writes the full state, exactly a
    plain optimizer's of the inner class. ``load_own_variables`` (so ``model.load_weights``
    once the sharded optimizer is built) takes such a full state and keeps this rank's part.
    :class:`~hvd_trainer.keras.callbacks.BroadcastGlobalVariablesCallback` broadcasts only
    ``iterations`` and the learning rate (:attr:`replicated_variables`). Elastic ``KerasState``
    syncs of a sharded optimizer are not supported.

    Example:
        >>> import hvd_trainer, hvd_trainer.keras as hvd_keras
        >>> hvd_trainer.init()
        >>> opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd_trainer.size()))
        >>> model.compile(optimizer=opt, loss="mse")
        >>> model.fit(x, y, callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])

    In-process recovery (``hvdrun --recovery in-process``, Keras elastic training with
    :func:`hvd_trainer.elastic.run`): built without ``world=``, the optimizer reduces over the
    current world, so it follows the world that ``elastic.run`` re-forms after a lost rank or a
    restarted worker's join. On torch the old world's hook reducer is dropped and one over the new
    world built before the next backward; on TensorFlow the traced step always holds the
    allreduce (in a one-rank world it only applies the scale factors) and looks the world up when
    it runs, and so does the ``1/size`` of local variables. The learning rate is not rescaled:
    do that in a reset callback (``state.register_reset_callbacks``), as in Horovod.
    :class:`~hvd_trainer.elastic.KerasState` empties a partly filled accumulation window when it
    loads a commit (:meth:`clear_accumulated_gradients`). Not supported there: ZeRO sharding
    (the first step in a new world raises :class:`DistributedOptimizerError`) and
    ``process_set`` (its ranks are the old world's).

    Local variables (Horovod's ``register_local_var`` and
    :func:`~hvd_trainer.keras.PartialDistributedOptimizer`): their gradients are not reduced;
    each rank applies its own, divided by the world size when ``scale_local_gradients`` (as
    Horovod does, so they have the scale of an averaged gradient).

    Sparse gradients (``tf.IndexedSlices`` of an ``Embedding`` on TensorFlow) are always
    reduced as dense tensors, whatever ``sparse_as_dense`` says: the applied update is the same
    as Horovod's allgather of the slices, at the cost of sending the whole table.

    ``opt.from_config(opt.get_config())`` returns a new ``DistributedOptimizer`` with the same
    options around a fresh inner optimizer (``get_config()`` is the inner optimizer's config);
    ``DistributedOptimizer.from_config`` on the class takes ``keras.optimizers.serialize(inner)``.

    Args (Horovod's order; ``world`` is keyword-only):
        optimizer: the Keras optimizer to wrap (not modified, except that a
            ``LossScaleOptimizer`` owns it under ``mixed_float16``).
        name: optional name (default ``"distributed_<inner name>"``).
        device_dense, device_sparse: accepted for Horovod's signature; unused (the reduction
            runs where the comm layer's backend puts it).
        compression: wire format of floating gradients: ``None``/``Compression.none``,
            ``Compression.fp16`` or ``Compression.bf16`` (a compressor instance or class from
            :mod:`hvd_trainer.keras.compression`, or the strings ``"none"``/``"fp16"``/``"bf16"``;
            see :meth:`~hvd_trainer.comm.ops.compression.Compression.resolve`); or the lossy
            ``Compression.int8`` / ``Compression.powersgd(rank=r)`` (strings ``"int8"``,
            ``"powersgd:R"``) with error feedback (see "Error feedback" above). Both backends.
            ``"auto"``: chosen once from the measured link and the step's measured compute
            (:mod:`hvd_trainer.comm.reduce.auto`: every rank on one host, plain allreduce when the
            optimizer is built; across hosts the first 7 updates reduce plain and are timed, then
            the choice holds), printed on rank 0.
        sparse_as_dense: accepted; sparse gradients are always reduced dense (see above).
        gradient_predivide_factor: with ``Average``, multiply by ``1/f`` before the sum and by
            ``f/size`` after it (same result, different rounding). Must be > 0.
        op: ``Average`` (default), ``Sum`` or ``Adasum`` (Maleki et al. 2021, arXiv:2006.02924:
            each variable's gradient combined across ranks by its dot products and norms, as
            Horovod does; with ``compression`` none, fp16 or bf16, not with ``zero_stage``).
        backward_passes_per_step: N >= 1, ``apply()`` calls per update (see above).
        average_aggregated_gradients: with N > 1, divide the accumulated sum by N (default
            False, as in Horovod).
        num_groups, groups: only the defaults (0, None): gradients of one dtype always go in
            one fused allreduce.
        process_set: average over this :class:`~hvd_trainer.comm.ProcessSet` only (``None``:
            the whole world); on ranks outside it the gradients are applied unreduced. Sizes
            (``Average``, predivide, local scaling) are the set's.
        scale_local_gradients: divide local variables' gradients by the world (or set) size
            (default True).
        zero_stage: ZeRO sharding (keyword; torch backend only; see "ZeRO" above). ``0``
            (default): every rank keeps the whole optimizer state. ``1``: each trainable
            variable is owned by one rank (balanced by bytes; the same plan on every rank, from
            the variable order and sizes); gradients are allreduced as with ``0``, each rank's
            inner optimizer is built on and steps only the variables it owns (so its slot
            variables take about ``1/N`` of the unsharded bytes, within one variable's), and
            the updated variables are then copied from their owners. ``2``: also the averaged
            gradients: the fused buckets are reduce-scattered, so a rank receives only its own
            variables' gradients. Ranks outside ``process_set`` and a single-rank run do not
            shard.
        world: the world to reduce over (default: the current one, looked up at each step, so
            that it follows in-process recovery; see above).

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer, or an unknown keyword argument.
        DistributedOptimizerError: (the option matrix is
            :class:`~hvd_trainer.comm.sync_options.SyncOptions`', shared with the torch optimizer
            and ``HorovodStrategy``) unsupported ``op``, ``compression`` or factor,
            ``backward_passes_per_step`` not an int >= 1 (``True`` included), or a
            ``num_groups``/``groups`` other than the default; ``zero_stage`` not an int
            0, 1 or 2 (``True`` and ``"2"`` included), or ``zero_stage > 0`` on a backend other
            than torch, with ``compression`` ``"int8"``/``"powersgd:R"``/``"auto"`` (or
            ``"fp16"`` in stage 2), with ``backward_passes_per_step > 1`` in stage 2, with a
            ``LossScaleOptimizer`` or the ``mixed_float16`` policy, with an inner optimizer that
            has ``use_ema=True`` or ``global_clipnorm`` or is already built.
    """

    def __init__(  # noqa: PLR0913 - Horovod's signature, positionally
        self,
        optimizer: keras.optimizers.Optimizer,
        name: str | None = None,
        device_dense: str = "",
        device_sparse: str = "",
        compression: Compressor | type[Compressor] | str | None = None,
        sparse_as_dense: bool = False,
        gradient_predivide_factor: float = 1.0,
        op: ReduceOp | str | None = None,
        backward_passes_per_step: int = 1,
        average_aggregated_gradients: bool = False,
        num_groups: int = 0,
        groups: Any = None,
        process_set: Any = None,
        scale_local_gradients: bool = True,
        *,
        zero_stage: int = 0,
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
        _check_unsupported(num_groups, groups)
        args = SyncOptions.check(
            error=DistributedOptimizerError, compression=compression, op=op,
            backward_passes_per_step=backward_passes_per_step,
            gradient_predivide_factor=gradient_predivide_factor, zero_stage=zero_stage,
            zero2_with_accumulation=False,  # an accumulation window is reduced by one allreduce
            allow_adasum=True,
        )
        compressor, zero_stage = args.compression, args.zero_stage
        _check_zero(zero_stage, optimizer)
        if _global_policy_is_mixed_float16() and not isinstance(optimizer, _LSO):
            # Keras' compile() would wrap us in a LossScaleOptimizer; its local finiteness test
            # would then skip our allreduce on one rank only. Own the LSO instead.
            optimizer = _LSO(optimizer)
        super().__init__(learning_rate=0.0, name=name or f"distributed_{optimizer.name}")
        self.inner_optimizer = optimizer
        self._options: dict[str, Any] = {
            "name": name, "compression": compression, "sparse_as_dense": bool(sparse_as_dense),
            "gradient_predivide_factor": gradient_predivide_factor, "op": op,
            "backward_passes_per_step": backward_passes_per_step,
            "average_aggregated_gradients": average_aggregated_gradients,
            "scale_local_gradients": bool(scale_local_gradients), "world": world,
            "process_set": process_set, "zero_stage": zero_stage,
        }
        self._op = args.op
        self._sync = GradientSync(args, world=world, process_set=process_set)
        # int8/powersgd: residuals (and Q) by "<index>:<variable path>". On torch without
        # accumulation the hook reducer holds them (this object only until it is built).
        self._feedback = FeedbackState(compressor.name) if compressor.error_feedback else None
        self._state_names: tuple[str, ...] | None = None  # _state_name of each variable, by build()
        self._passes = args.backward_passes_per_step
        self._average_passes = bool(average_aggregated_gradients)
        self._accum: Any = None  # _accumulate.TFAccumulation / TorchAccumulation when N > 1
        self._predivide = args.gradient_predivide_factor
        self._scale_local = bool(scale_local_gradients)
        self._process_set = process_set
        self._local = _LocalVariables()  # not a list: Keras' tracker would adopt list entries
        self._zero_stage = zero_stage
        self._zero: KerasZero | None = None  # by build(), when this rank shards (size > 1)
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

    from_config = _FromConfig()

    def _rebuild(self, config: dict[str, Any], custom_objects: dict[str, Any] | None = None):
        """``opt.from_config(config)``: the same options around ``type(inner).from_config``."""
        inner = type(self.inner_optimizer).from_config(config, custom_objects=custom_objects)
        options = dict(self._options)
        if options["name"] is None:
            options.pop("name")
        clone = DistributedOptimizer(inner, **options)
        for var in self._local.variables:
            clone.register_local_var(var)
        return clone

    # -- local variables --------------------------------------------------------------------
    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local: not reduced, divided by the world size when
        ``scale_local_gradients`` (Horovod's ``register_local_var``).

        Raises:
            TypeError: ``var`` is not a ``keras.Variable``.
        """
        if not isinstance(var, keras.Variable):
            raise TypeError(
                f"register_local_var expects a keras.Variable, got {type(var).__name__} ({var!r}). "
                "HINT: register each of layer.trainable_weights."
            )
        if self._zero is not None and not self._local.contains(var):
            raise DistributedOptimizerError(
                f"register_local_var({var.path!r}) after the optimizer was built with "
                f"zero_stage={self._zero_stage}: the shard plan (which rank owns which variable) "
                "is fixed at build. HINT: register local variables before the first step or build()."
            )
        if not self._local.add(var):
            return
        if self._reducer is not None:  # torch: the hook reducer must skip it from now on
            self._build_torch_reducer(built_trainable_variables(self))

    @property
    def local_variables(self) -> list[Any]:
        """The variables registered with :meth:`register_local_var` (in registration order)."""
        return list(self._local.variables)

    def _local_mask(self, variables: Sequence[Any]) -> list[bool]:
        return [self._local.contains(v) for v in variables]

    def _reduce_size(self) -> int:
        """How many ranks a gradient is averaged over: the process set's size, else the world's."""
        return self.world.size if self._process_set is None else self._process_set.size()

    def _reduces(self) -> bool:
        """Whether this rank takes part in gradient reductions (> 1 rank, member of the set)."""
        if self._process_set is None:
            return self.world.size > 1
        return self._process_set.included() and self._process_set.size() > 1

    def _local_factor(self, passes: int = 1) -> float:
        factor = 1.0 / self._reduce_size() if self._scale_local else 1.0
        return factor / passes if passes > 1 and self._average_passes else factor

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
        if self._zero is None:
            self.inner_optimizer.save_own_variables(store)
            return
        if self._zero.consolidated is None:
            raise DistributedOptimizerError(
                f"cannot save the optimizer: with zero_stage={self._zero_stage} each rank holds only "
                "its shard of the optimizer variables, and they were not consolidated on this rank "
                "since the last step (a partial state is never written). HINT: call "
                "optimizer.consolidate_variables(to=r) on every rank, then save (model.save, "
                "save_own_variables) on rank r only."
            )
        self._zero.consolidated.save_own_variables(store)

    def load_own_variables(self, store) -> None:
        if self._zero is None:
            self.inner_optimizer.load_own_variables(store)
            return
        try:
            self._zero.load_full(self.inner_optimizer, built_trainable_variables(self), store)
        except ValueError as exc:
            raise DistributedOptimizerError(f"cannot load the optimizer variables: {exc}") from exc

    def __dir__(self):
        # With ZeRO the inner optimizer holds a shard: keep Keras' saver (which walks dir())
        # from writing or loading it as a child; save_own_variables writes the full state.
        names = super().__dir__()
        if self.__dict__.get("_zero_stage"):
            names = [n for n in names if n != "inner_optimizer"]
        return names

    @property
    def wire_bytes_sent(self) -> int:
        """Bytes this rank has put on the wire for gradients so far, on every path (the hook
        reducer on torch, the TensorFlow bridge, accumulated windows, error feedback), counted
        as :attr:`hvd_trainer.comm.GradientReducer.wire_bytes_sent` counts them; kept across
        a rebuilt reducer (a local variable registered, a re-formed world)."""
        return self._sync.wire_bytes_sent

    @property
    def _reducer(self) -> GradientReducer | None:
        """The torch backend's hook reducer (``None``: not built, TensorFlow, accumulation)."""
        return self._sync.reducer

    @property
    def zero_stage(self) -> int:
        """The ``zero_stage`` this optimizer was built with (0, 1 or 2)."""
        return self._zero_stage

    @property
    def replicated_variables(self) -> list[Any]:
        """The optimizer variables every rank holds the same value of: all of them, or with
        ZeRO sharding active only ``iterations`` and the learning rate (the slots are each rank's
        shard). What :class:`~hvd_trainer.keras.callbacks.BroadcastGlobalVariablesCallback`
        broadcasts."""
        if self._zero is None:
            return self.inner_optimizer.variables
        return replicated(self.inner_optimizer)

    def consolidate_variables(self, to: int = 0) -> None:
        """Gather the full (unsharded) optimizer variables on rank ``to`` (a collective: call it
        on every rank of the process set; ``to`` is a rank of that set).

        Afterwards, until the next step, rank ``to``'s :meth:`save_own_variables` (so
        ``model.save``) writes exactly the variables an unwrapped optimizer of the inner class
        would have, loadable by a plain Keras optimizer; other ranks still refuse to save. The
        full copy lives on rank ``to`` only (the size of the unsharded state). Without ZeRO
        sharding (``zero_stage=0``, one rank, or a rank outside the process set) this does
        nothing.

        Raises:
            DistributedOptimizerError: the optimizer is not built yet, or ``to`` is out of range.
        """
        if self._zero_stage and not self.built:
            raise DistributedOptimizerError(
                "consolidate_variables() before the optimizer was built: there is no state yet. "
                "HINT: call it after training steps (or optimizer.build(model.trainable_variables))."
            )
        if self._zero is None:
            return
        try:
            self._zero.consolidate(self.inner_optimizer, built_trainable_variables(self), to)
        except ValueError as exc:
            raise DistributedOptimizerError(f"consolidate_variables(to={to}): {exc}") from exc

    def full_state(self) -> dict[str, np.ndarray]:
        """Every optimizer variable (``iterations``, the learning rate, every slot) by its Keras
        ``name``, as numpy arrays: what an unwrapped optimizer of the inner class would hold.
        With ZeRO sharding active the shards of every rank are gathered on every rank (a
        collective: call it on every rank of the process set); otherwise this rank's own.
        :meth:`load_full_state` takes it back in a world of any size (``KerasState`` commits it).

        Raises:
            DistributedOptimizerError: the optimizer is not built yet, or two ranks hold a
                variable of the same name.
        """
        if not self.built:
            raise DistributedOptimizerError(
                "full_state() before the optimizer was built: there is no state yet. HINT: call "
                "optimizer.build(model.trainable_variables) first."
            )
        if self._zero is None:
            return {v.name: np.array(keras.ops.convert_to_numpy(v)) for v in self.inner_optimizer.variables}
        try:
            return self._zero.gather_all(self.inner_optimizer)
        except ValueError as exc:
            raise DistributedOptimizerError(f"full_state(): {exc}") from exc

    def load_full_state(self, full: dict[str, np.ndarray]) -> None:
        """Load :meth:`full_state`'s variables into the current world.

        With ``zero_stage``, when the world is not the one the shards were planned for (after an
        in-process re-form the ranks that held the old shards are not the ranks of now), the
        ownership is planned again for the current world (or process set): a fresh inner
        optimizer of the same class and config is built on this rank's share (on every variable
        in a world of one) and the gradient reducer is built again over the world. Then every
        variable takes its value from ``full`` by name (without ``zero_stage``: the inner
        optimizer's variables).

        Raises:
            DistributedOptimizerError: the optimizer is not built yet, or ``full`` lacks one of
                its variables (saved from another model or optimizer).
        """
        if not self.built:
            raise DistributedOptimizerError(
                "load_full_state() before the optimizer was built. HINT: call "
                "optimizer.build(model.trainable_variables) first."
            )
        if self._zero_stage and not self._shards_fit_world():
            self._replan_zero()
        missing = [v.name for v in self.inner_optimizer.variables if v.name not in full]
        if missing:
            raise DistributedOptimizerError(
                f"load_full_state(): no value for the optimizer variables {missing[:3]} (of "
                f"{len(missing)}). HINT: load a state saved from this model and optimizer class."
            )
        for v in self.inner_optimizer.variables:
            v.assign(full[v.name])

    def _shards_fit_world(self) -> bool:
        """Whether the ZeRO plan (or its absence, in a world of one) is the current world's."""
        if not self._reduces():
            return self._zero is None
        return self._zero is not None and \
            self._zero.pset is resolve_set(self._process_set, self.world, "ZeRO sharding")

    def _replan_zero(self) -> None:
        """A fresh inner optimizer, reducer and ZeRO plan for the current world (see
        :meth:`load_full_state`); the old shards' values are dropped."""
        var_list = list(built_trainable_variables(self))
        self._sync.release()
        self._zero = None
        inner = self.inner_optimizer
        self.inner_optimizer = type(inner).from_config(inner.get_config())
        if self._reduces():
            if self._passes == 1:  # as build(): an accumulation window reduces by allreduce
                self._build_torch_reducer(var_list)
            self._build_zero(var_list)
        else:
            self.inner_optimizer.build(var_list)

    def scale_loss(self, loss):
        self._follow_world()  # torch: before backward, whose hooks start the reduction
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
        """The world gradients are reduced over: the one passed in, else the current one, looked
        up at each use (in-process recovery replaces it; see :meth:`_follow_world`)."""
        return self._sync.world

    def _follow_world(self) -> None:
        """torch backend, after in-process recovery replaced the current world: drop the hook
        reducer built for the old one (its hooks, its broken in-flight work) and build one over
        the new world when it has other ranks (error-feedback state carried over). Runs before
        each backward (``scale_loss``) and at ``apply()``, so the first step in a new world reduces
        over it. On TensorFlow the traced step looks the world up when it runs (see
        :meth:`_reduces_in_graph`).

        Raises:
            DistributedOptimizerError: ZeRO sharding is active and no commit was restored in the
                new world (its shards belong to the old world; see :meth:`load_full_state`).
        """
        if self._tf or not self.built or self._passes > 1:
            return
        world = self.world
        if self._reducer is not None and self._reducer.world is world:
            return
        if self._zero is not None:
            raise DistributedOptimizerError(
                f"zero_stage={self._zero_stage}: the world changed (in-process recovery) but the "
                "optimizer state is still sharded over the old world's ranks, some of which are "
                "gone. HINT: restore a commit first: hvd.elastic.KerasState with @hvd.elastic.run "
                "does it (load_full_state plans the shards for the new world)."
            )
        if self._reducer is not None:
            self._feedback = self._feedback_state()
        measuring = self._sync.auto_measuring
        self._sync.follow_world()  # the reducer released; "auto" still measuring forgotten
        if measuring and not self._sync.auto_measuring:  # measure again, in the new world
            self._resolve_auto_compression(built_trainable_variables(self))
        if self._reduces():
            self._build_torch_reducer(built_trainable_variables(self))

    def _reduces_in_graph(self) -> bool:
        """TensorFlow, at trace time: whether the traced step holds the gradient reduction. With
        in-process recovery the world may shrink or grow after the trace (Keras keeps the traced
        function), so it always does; at run time a one-rank world only applies the scale factors."""
        if self._process_set is None and in_process_recovery():
            return True
        return self._reduces()

    def build(self, var_list: Sequence[Any]) -> None:
        sharded = bool(self._zero_stage) and self._reduces()
        if not sharded:
            self.inner_optimizer.build(var_list)
        super().build(var_list)
        self._resolve_auto_compression(var_list)
        self._state_names = tuple(_state_name(i, v) for i, v in enumerate(var_list))
        if self._feedback is not None and not self._feedback.empty:
            self._feedback.load_state_dict(self._rekeyed(self._feedback.state_dict()))
        if self._passes > 1:
            kind = _accumulate.TFAccumulation if self._tf else _accumulate.TorchAccumulation
            self._accum = kind(list(var_list), self._passes)
        elif not self._tf and self._reduces():
            self._build_torch_reducer(var_list)
        if sharded:
            self._build_zero(list(var_list))

    def _sharded_variables(self, var_list: Sequence[Any]) -> list[Any]:
        """The variables ZeRO shards: trainable and not local, in ``var_list``'s order."""
        local = self._local_mask(var_list)
        return [v for v, is_local in zip(var_list, local, strict=True) if v.trainable and not is_local]

    def _build_zero(self, var_list: list[Any]) -> None:
        """Plan the ownership and build the inner optimizer on the owned variables only."""
        if self.inner_optimizer.built:
            raise DistributedOptimizerError(
                f"zero_stage={self._zero_stage}: the inner optimizer {self.inner_optimizer.name!r} "
                "is already built (it holds state for every variable). HINT: wrap a fresh, "
                "unbuilt Keras optimizer."
            )
        pset = resolve_set(self._process_set, self.world, "ZeRO sharding")
        plan = self._reducer.plan if isinstance(self._reducer, ShardedGradientReducer) else None
        self._zero = KerasZero(self._zero_stage, self._sharded_variables(var_list), pset, plan)
        self.inner_optimizer.build([v for v in var_list if self._zero.owns(v)])

    def _resolve_auto_compression(self, var_list: Sequence[Any]) -> None:
        """``compression="auto"``: start choosing at build
        (:meth:`~hvd_trainer.comm.GradientSync.start_auto`: every rank on one host, chosen now;
        across hosts the first steps reduce plain and are timed, then the choice holds)."""
        grad_bytes = sum(math.prod(v.shape) * 4 for v in var_list if v.trainable)
        self._sync.start_auto(grad_bytes, self.world.device)
        self._match_feedback()

    def _match_feedback(self) -> None:
        """The error-feedback state of the TensorFlow bridge and accumulation windows: a fresh
        one when ``"auto"`` chose a compressor with error feedback."""
        compression = self._sync.compression
        stale = self._feedback is None or self._feedback.compressor != compression.name
        if compression.error_feedback and stale:
            self._feedback = FeedbackState(compression.name)

    def _auto_step_end(self) -> None:
        """After a reduction while ``"auto"`` measures (one per optimizer update): count it; when
        it chose a compressor, the torch backend's hook buckets are built again with it (the
        TensorFlow bridge reads the choice at its next call)."""
        had_reducer = self._reducer is not None
        if self._sync.step_end() is None:
            return
        self._match_feedback()
        if had_reducer and self._reducer is None:
            self._build_torch_reducer(built_trainable_variables(self))

    @property
    def compression(self) -> Compressor:
        """The compressor in use (``Compression.none`` while ``"auto"`` measures)."""
        return self._sync.compression

    def _build_torch_reducer(self, var_list: Sequence[Any]) -> None:
        local = self._local_mask(var_list)
        named = [(_state_name(i, v), v.value) for i, v in enumerate(var_list) if v.trainable and not local[i]]
        op, pre, post = self._scales()
        carry = self._feedback_state()  # a loaded state, or the reducer's before a rebuild
        self._sync.build(named, op=op, prescale_factor=pre, postscale_factor=post,
                         sharded=self._zero_stage == 2,
                         feedback=None if carry is None or carry.empty else carry.state_dict())

    def apply(self, grads, trainable_variables=None):
        if not self.built and trainable_variables is not None:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._follow_world()
        if self._passes > 1:
            self._apply_accumulated(grads, trainable_variables)
            return
        if self._reduces_in_graph() if self._tf else self._reduces():
            tvs = built_trainable_variables(self) if trainable_variables is None else trainable_variables
            grads = self._reduce_tf(grads, tvs) if self._tf else self._reduce_torch(grads, tvs)
        self._inner_apply(grads, trainable_variables)
        if not self._tf:
            self._auto_step_end()

    def _inner_apply(self, grads, trainable_variables) -> None:
        """The inner optimizer's ``apply``; with ZeRO on the owned variables only, followed by
        the exchange of the updated variables (every rank, every update)."""
        if self._zero is None:
            self.inner_optimizer.apply(grads, trainable_variables)
            return
        tvs = built_trainable_variables(self) if trainable_variables is None else list(trainable_variables)
        mine = [(g, v) for g, v in zip(grads, tvs, strict=True) if self._zero.owns(v)]
        self._zero.consolidated = None  # a consolidated copy is stale from now on
        if any(g is not None for g, _ in mine):
            self.inner_optimizer.apply([g for g, _ in mine], [v for _, v in mine])
        else:  # nothing to step here: iterations still advance, as on the other ranks
            _accumulate.iteration_variable(self.inner_optimizer).assign_add(1)
        self._zero.exchange()

    def _apply_accumulated(self, grads, trainable_variables) -> None:
        """N > 1: accumulate; on the N-th call reduce the sums and apply them (class docstring)."""
        tvs = built_trainable_variables(self) if trainable_variables is None else list(trainable_variables)
        counter = _accumulate.iteration_variable(self.inner_optimizer)
        if self._tf:
            def update(summed):
                if self._reduces_in_graph():
                    summed = self._reduce_tf(summed, tvs, passes=self._passes)
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
            with self._sync.waiting():
                reduced = self._reduce_torch_sums(tvs)
            self._inner_apply(reduced, tvs)
        finally:
            self._accum.reset()
        self._auto_step_end()

    def _reduce_torch_sums(self, tvs: Sequence[Any]) -> list[Any]:
        """Reduce the accumulators in place (one grouped allreduce, local variables' sums only
        scaled); None where no rank had a gradient."""
        acc = self._accum
        if self._reduces() and self._feedback is not None:
            self._reduce_torch_sums_with_feedback(tvs)
        elif self._reduces():
            local = self._local_mask(tvs)
            op, pre, post = self._scales(passes=self._passes)
            shared = [s for s, is_local in zip(acc.sums, local, strict=True) if not is_local]
            self._sync.count_sent(self.compression.allreduce_wire_bytes(
                [*shared, acc.used], self._reduce_size(), adasum=op is ReduceOp.ADASUM))
            grouped_allreduce_([*shared, acc.used], op=op, name="keras.accumulated_gradients",
                               prescale_factor=pre, postscale_factor=post,
                               compression=self.compression, process_set=self._process_set,
                               world=self.world)
            factor = self._local_factor(self._passes)
            for s, is_local in zip(acc.sums, local, strict=True):
                if is_local and factor != 1.0:
                    s.mul_(factor)
        elif self._average_passes:
            for s in acc.sums:
                s.div_(self._passes)
        used = acc.used.tolist()
        return [s if u > 0 else None for s, u in zip(acc.sums, used, strict=True)]

    def _reduce_torch_sums_with_feedback(self, tvs: Sequence[Any]) -> None:
        """int8/powersgd: the window's sums reduced with error feedback (once per window, so the
        residual is applied once per reduction); local variables' sums only scaled and their
        "used" flags kept local."""
        acc = self._accum
        local = self._local_mask(tvs)
        shared = [i for i, is_local in enumerate(local) if not is_local]
        op, pre, post = self._scales(passes=self._passes)
        before = self._feedback.bytes_sent
        reduced, used = reduce_with_feedback(
            [(_state_name(i, tvs[i]), acc.sums[i]) for i in shared], compressor=self.compression,
            state=self._feedback, world=self.world, op=op, prescale_factor=pre, postscale_factor=post,
            process_set=self._process_set, name="keras.accumulated_gradients",
            used=[float(acc.used[i]) for i in shared])
        self._sync.count_sent(self._feedback.bytes_sent - before)
        for i, r, u in zip(shared, reduced, used, strict=True):
            acc.sums[i].copy_(r)
            acc.used[i] = u
        factor = self._local_factor(self._passes)
        for s, is_local in zip(acc.sums, local, strict=True):
            if is_local and factor != 1.0:
                s.mul_(factor)

    def _scales(self, passes: int = 1) -> tuple[ReduceOp, float, float]:
        """(op, prescale, postscale) for the allreduce: predivide factor and the 1/N of
        ``average_aggregated_gradients`` folded into the factors."""
        op, pre, post = self._op, 1.0, 1.0
        if op is ReduceOp.AVERAGE and self._predivide != 1.0:
            op, pre, post = ReduceOp.SUM, 1.0 / self._predivide, self._predivide / self._reduce_size()
        if passes > 1 and self._average_passes:
            post /= passes
        return op, pre, post

    def _reduce_torch(self, grads, tvs):
        assert self._reducer is not None
        with self._sync.waiting():
            self._reducer.wait()
        local, factor = self._local_mask(tvs), self._local_factor()
        # wait() may have given an unused parameter a (zero, then averaged) gradient.
        return [
            (None if g is None else g * factor) if is_local else (v.value.grad if v.trainable else g)
            for g, v, is_local in zip(grads, tvs, local, strict=True)
        ]

    def _reduce_tf(self, grads, tvs, passes: int = 1):
        import tensorflow as tf

        if in_xla_context():
            raise DistributedOptimizerError(
                "DistributedOptimizer cannot run inside an XLA-compiled function "
                "(jit_compile=True): its allreduce leaves the graph. HINT: "
                "model.compile(..., jit_compile=False), or add "
                "BroadcastGlobalVariablesCallback, which switches it off with a warning."
            )
        local = self._local_mask(tvs)
        out = list(grads)
        factor: Any = self._local_factor(passes)
        if any(local) and in_process_recovery():  # 1/size of the world the step runs in, not the trace's
            factor = tf.ensure_shape(tf.numpy_function(
                lambda: np.float64(self._local_factor(passes)), [], Tout=tf.float64, stateful=True,
                name="hvd_local_factor"), [])
        for i, g in enumerate(grads):
            if local[i] and g is not None:
                out[i] = tf.convert_to_tensor(g) * tf.cast(factor, g.dtype)
        idx = [i for i, g in enumerate(grads) if g is not None and not local[i]]
        # IndexedSlices (sparse Embedding gradients) become dense here: see the class docstring
        dense = [tf.convert_to_tensor(grads[i]) for i in idx]
        if not dense:
            return out
        names = [_state_name(i, tvs[i]) for i in idx]
        if self._sync.auto_measuring:  # the choice is read at run time
            reduce = functools.partial(self._reduce_numpy_auto, names, passes)
        elif self._feedback is not None:  # state by variable: the names travel with the function
            reduce = functools.partial(self._reduce_numpy_with_feedback, names, passes)
        elif passes == 1:
            reduce = self._reduce_numpy
        else:
            reduce = self._reduce_numpy_accumulated
        reduced = tf.numpy_function(
            reduce, dense, Tout=[g.dtype for g in dense], stateful=True,
            name="hvd_allreduce",
        )
        for i, g, r in zip(idx, dense, reduced, strict=True):
            out[i] = tf.ensure_shape(r, g.shape)
        return out

    def _reduce_numpy(self, *arrays, passes: int = 1):
        op, pre, post = self._scales(passes)
        return _bridge.allreduce_arrays(
            arrays, world=self.world, op=op, prescale_factor=pre, postscale_factor=post,
            compression=self.compression, buffers=self._buffers, process_set=self._process_set,
            on_sent=self._sync.count_sent,
        )

    def _reduce_numpy_accumulated(self, *arrays):
        return self._reduce_numpy(*arrays, passes=self._passes)

    def _reduce_numpy_auto(self, names: list[str], passes: int, *arrays):
        """TensorFlow, traced while ``"auto"`` measured: the reduction its choice asks for (plain
        and timed until it chose; one call per optimizer update)."""
        if self._feedback is not None:
            return self._reduce_numpy_with_feedback(names, passes, *arrays)
        if not self._sync.auto_measuring:
            return self._reduce_numpy(*arrays, passes=passes)
        with self._sync.waiting():
            out = self._reduce_numpy(*arrays, passes=passes)
        self._auto_step_end()
        return out

    def _reduce_numpy_with_feedback(self, names: list[str], passes: int, *arrays):
        op, pre, post = self._scales(passes)
        before = self._feedback.bytes_sent
        out = _bridge.allreduce_arrays_with_feedback(
            arrays, names, compressor=self.compression, state=self._feedback, world=self.world,
            op=op, prescale_factor=pre, postscale_factor=post, process_set=self._process_set,
        )
        self._sync.count_sent(self._feedback.bytes_sent - before)
        return out

    def clear_accumulated_gradients(self) -> None:
        """Empty the gradient-accumulation window (``backward_passes_per_step > 1``): the local
        sums and the pass counter go back to zero, so the next ``apply()`` is the window's first
        pass. :class:`~hvd_trainer.elastic.KerasState` calls it when it loads a commit: the window
        held gradients of steps after the commit, and after a recovery every rank (a restarted
        one too) must count the window from the same step. No-op with one pass per step."""
        if self._accum is not None:
            self._accum.reset()

    # -- error-feedback state (int8, powersgd) ------------------------------------------------
    def _feedback_state(self) -> FeedbackState | None:
        return self._reducer.feedback_state if self._reducer is not None else self._feedback

    def compression_state_dict(self) -> dict[str, Any] | None:
        """Copies of this rank's error-feedback state, or ``None`` for stateless compression.

        With ``compression="int8"``/``"powersgd:R"``: ``{"compressor": name, "residuals":
        {name: tensor}, "q": {name: tensor}}`` (CPU or device ``torch`` tensors, fp32; names are
        ``"<index>:<variable path>"``, the same on both backends, and loading matches them by
        the index). Training state that Keras' own saving does not hold: save it next to the
        model (e.g. ``torch.save``, one file per rank, since the residuals are each rank's own)
        and give it back with :meth:`load_compression_state_dict` to resume bit-identically.
        """
        state = self._feedback_state()
        return None if state is None else state.state_dict()

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`compression_state_dict`'s output (before or after the first step).

        Raises:
            DistributedOptimizerError: this optimizer's compression keeps no state.
            ValueError: the state was saved with another compression.
        """
        current = self._feedback_state()
        if current is None:
            raise DistributedOptimizerError(
                f"load_compression_state_dict: this optimizer uses compression="
                f"{self.compression!r}, which has no error-feedback state. HINT: build the "
                f"optimizer with the compression the state was saved with "
                f"({state.get('compressor')!r})."
            )
        if self._reducer is not None:
            self._reducer.load_compression_state_dict(self._rekeyed(state))
        else:  # before build(), kept as saved and re-keyed there
            current.load_state_dict(self._rekeyed(state))

    def _rekeyed(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with its keys matched to this optimizer's variables by the index before the
        ``":"`` (auto-generated layer names, hence paths, differ when a model is built again in
        the same process); unchanged before ``build()``."""
        if self._state_names is None:
            return state
        by_index = {n.partition(":")[0]: n for n in self._state_names}

        return rename_feedback(state, lambda k: by_index.get(k.partition(":")[0], k))


def _state_name(index: int, variable: Any) -> str:
    """The error-feedback state's key of the ``index``-th trainable variable (both backends)."""
    return f"{index}:{variable.path}"


def _check_unsupported(num_groups: Any, groups: Any) -> None:
    if num_groups not in (0, None) or groups is not None:
        raise DistributedOptimizerError(
            f"num_groups={num_groups!r}, groups={groups!r}: the Keras DistributedOptimizer always "
            "fuses the gradients of one dtype into one allreduce. HINT: leave num_groups and "
            "groups at their defaults."
        )


def _check_zero(stage: int, optimizer: Any) -> None:
    """Refuse ZeRO (``stage``, checked with the other options) on a backend or with an inner
    optimizer it does not run with."""
    if stage == 0:
        return
    backend = keras.backend.backend()
    if backend != "torch":
        raise DistributedOptimizerError(
            f"zero_stage={stage} is implemented for the torch backend only, got "
            f"KERAS_BACKEND={backend!r}. HINT: set KERAS_BACKEND=torch before importing keras, "
            "or use zero_stage=0 on this backend."
        )
    _check_zero_optimizer(stage, optimizer)


def _check_zero_optimizer(stage: int, optimizer: Any) -> None:
    """Refuse an inner optimizer whose features need every variable's gradient or state."""
    if isinstance(optimizer, _LSO) or _global_policy_is_mixed_float16():
        raise DistributedOptimizerError(
            f"zero_stage={stage} with a LossScaleOptimizer (or the mixed_float16 policy): its "
            "skip-on-inf decision and loss scale would be taken from each rank's shard only. "
            "HINT: use zero_stage=0 with mixed_float16, or mixed_bfloat16 (no loss scaling)."
        )
    if getattr(optimizer, "use_ema", False):
        raise DistributedOptimizerError(
            f"zero_stage={stage} with use_ema=True: the moving averages would be kept (and "
            "written into the model) by the owning rank only. HINT: use_ema=False, or zero_stage=0."
        )
    if getattr(optimizer, "global_clipnorm", None) is not None:
        raise DistributedOptimizerError(
            f"zero_stage={stage} with global_clipnorm: each rank's inner optimizer sees only its "
            "own variables' gradients, so the global norm would be a shard's. HINT: clipnorm= or "
            "clipvalue= (per variable) work, or use zero_stage=0."
        )
    if optimizer.built:
        raise DistributedOptimizerError(
            f"zero_stage={stage}: the optimizer {optimizer.name!r} is already built (it holds state "
            "for every variable). HINT: wrap a fresh, unbuilt Keras optimizer."
        )


def _global_policy_is_mixed_float16() -> bool:
    return keras.config.dtype_policy().name == "mixed_float16"

"""Horovod-style ``DistributedOptimizer`` for plain torch training loops.

The wrapper *composes* the user's optimizer: it shares the inner optimizer's ``param_groups``,
``state`` and ``defaults`` (they are properties that read the inner object, so
``load_state_dict`` replacing the inner lists is seen at once), and adds gradient averaging:

1. A ``post_accumulate_grad`` hook on every trainable parameter counts backward passes.
   The dense gradients go through :class:`hvd_trainer.comm.GradientReducer` (fused buckets,
   allreduce launched while backward still runs); the reducer only sends on the
   ``backward_passes_per_step``-th pass, earlier passes accumulate locally.
2. :meth:`DistributedOptimizer.synchronize` waits for the reduction (and reduces sparse
   gradients by allgather, see :mod:`hvd_trainer.torch.sparse`). ``step()`` calls it unless it ran
   already or ``skip_synchronize()`` is active.
3. Reading ``param_groups`` while a reduction is due finishes it first, so
   ``GradScaler.unscale_``/``step`` and clipping over ``param_groups`` see the averaged
   gradients on every rank (the inf check then agrees on every rank).

With ``op=hvd.Adasum`` no gradient is reduced: ``step()`` applies the local gradients and
combines the weight changes across ranks (:mod:`hvd_trainer.torch.adasum_step`, Horovod's
semantics).

The reducer is built at the first ``synchronize()``, once every rank has seen which
parameters produce sparse gradients (one small allreduce agrees on it); from then on the
dense allreduces overlap backward.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from hvd_trainer.comm import (
    Average,
    CommValueError,
    Compression,
    Compressor,
    FusionConfig,
    GradientReducer,
    GradientSync,
    Max,
    OptimizerArgumentError,
    ReduceOp,
    ReducerSet,
    Sum,
    SyncOptions,
    World,
    ZeroSharding,
    allreduce,
    check_backward_passes_per_step,
    get_world,
    init_optimizer_bookkeeping,
)
from hvd_trainer.torch.adasum_step import adasum_step
from hvd_trainer.torch.groups import resolve_groups
from hvd_trainer.torch.sparse import sparse_allreduce

__all__ = ["DistributedOptimizer", "GradientSyncError", "OptimizerConfigError", "EXTRA_STATE_KEY"]


EXTRA_STATE_KEY = "hvd_trainer"
"""Key of hvd_trainer's own training state (error feedback) in an optimizer's ``state_dict``."""


class OptimizerConfigError(OptimizerArgumentError):
    """An argument of :class:`DistributedOptimizer` is invalid (a ``ValueError``)."""


class GradientSyncError(RuntimeError):
    """The training loop called the optimizer out of order (e.g. ``zero_grad()`` while the
    gradients of this step are still being reduced)."""


def _resolve_named(
    optimizer: torch.optim.Optimizer, named_parameters: Iterable[Any] | None
) -> list[tuple[str, torch.Tensor]]:
    """``(name, param)`` for every parameter of ``optimizer``, in a rank-independent order."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return [
            (f"param_group{g}.param{i}", p)
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
        ]
    named = list(named_parameters)
    names: set[str] = set()
    ids: dict[int, str] = {}
    for entry in named:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            raise OptimizerConfigError(
                f"named_parameters must hold (name, tensor) tuples, got {entry!r:.80}. "
                "HINT: pass model.named_parameters()."
            )
        name, p = entry
        if name in names or id(p) in ids:
            raise OptimizerConfigError(
                f"named_parameters lists {name!r} twice (same name or same tensor as "
                f"{ids.get(id(p), name)!r}). HINT: names and tensors must be unique."
            )
        names.add(name)
        ids[id(p)] = name
    missing = [tuple(p.shape) for p in params if id(p) not in ids]
    if missing:
        raise OptimizerConfigError(
            f"named_parameters misses {len(missing)} parameter(s) of the optimizer (shapes "
            f"{missing[:5]}). HINT: pass the named_parameters() of every module the optimizer "
            "updates, or named_parameters=None."
        )
    in_opt = {id(p) for p in params}
    return [(n, p) for n, p in named if id(p) in in_opt]


def _check_sparse_arg(sparse: Any, sparse_as_dense: bool) -> None:
    """Validate Horovod 0.21's ``sparse=`` (see :class:`DistributedOptimizer`)."""
    if sparse is None:
        return
    if not isinstance(sparse, bool | dict):
        raise OptimizerConfigError(
            f"sparse={sparse!r} must be True, False or a dict of parameter to bool (Horovod 0.21). "
            "HINT: drop it: sparse gradients are allgathered by default (sparse_as_dense=False)."
        )
    wants_sparse = sparse is True or (isinstance(sparse, dict) and any(sparse.values()))
    if wants_sparse and sparse_as_dense:
        raise OptimizerConfigError(
            "sparse=True with sparse_as_dense=True: one asks for sparse gradients to travel "
            "sparse, the other dense. HINT: keep sparse_as_dense and drop sparse."
        )


class DistributedOptimizer(torch.optim.Optimizer):
    """Average gradients over ranks (overlapping backward), then run the wrapped optimizer.

    Example:
        >>> opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                                named_parameters=model.named_parameters())
        >>> loss.backward()
        >>> opt.synchronize()                       # optional: clip averaged gradients
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        >>> with opt.skip_synchronize():
        ...     opt.step()

    No learning rate is changed. ``isinstance(opt, torch.optim.Optimizer)`` holds (LR
    schedulers and ``GradScaler`` accept it); ``isinstance(opt, torch.optim.SGD)`` does not.

    With AMP, ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` works as
    is: ``GradScaler`` reads ``opt.param_groups``, which finishes the reduction, so every rank
    unscales the same averaged gradients and takes the same skip decision on inf/NaN. Horovod's
    explicit form (``opt.synchronize(); scaler.unscale_(opt); clip; with
    opt.skip_synchronize(): scaler.step(opt)``) works too.

    Notes:
        * The first ``synchronize()`` builds the gradient buckets, so the first step's
          allreduce starts after backward; later steps overlap it with backward.
        * A trainable parameter without a gradient on some rank gets a zero gradient there
          (all ranks take part in every bucket), so it is updated like one with a zero gradient.
        * Parameters are those with ``requires_grad=True`` at construction (or added with
          ``add_param_group``), and one frozen then and unfrozen later: the ``synchronize()``
          that first sees its gradient builds the buckets again with it (every rank must
          unfreeze it at the same step; a mismatch is an error there). Horovod leaves such a
          parameter local, so the ranks drift apart.

    Args:
        optimizer: the torch optimizer to wrap (not copied; its state is shared).
        named_parameters: ``(name, param)`` for every parameter of ``optimizer``; names must
            be unique. ``None`` names them by position.
        compression: ``None`` (the default, same as ``Compression.none``),
            ``Compression.fp16``/``.bf16``, a ``Compressor`` subclass, or the strings
            ``"none"``/``"fp16"``/``"bf16"`` (see :meth:`hvd_trainer.Compression.resolve`);
            or the lossy ``Compression.int8`` / ``Compression.powersgd(rank=r)`` (strings
            ``"int8"``, ``"powersgd:R"``) with error feedback: the per-parameter residuals (and
            PowerSGD's Q) are training state, in :meth:`state_dict` under ``"hvd_trainer"``.
            ``"auto"``: chosen from the measured link and the step's measured compute
            (:mod:`hvd_trainer.comm.reduce.auto`): all ranks on one host, none, at the first
            ``synchronize()``; across hosts the first 7 ``step()`` calls reduce plain and are
            timed, then the buckets are built again with the choice. Printed on rank 0 and
            readable as :attr:`compression`.
        backward_passes_per_step: backward passes accumulated locally per ``step()``. Nothing
            is sent before the last one. Gradients are summed, not divided by this number.
        op: ``Average`` (default), ``Sum``, or ``Adasum``: each rank steps the inner optimizer
            on its own gradient and the weight changes are combined with Adasum (as Horovod's
            Adasum optimizer; ``groups``, ``sparse_as_dense`` and the fusion config then do not
            apply, and ``synchronize()`` leaves the gradients local).
        gradient_predivide_factor: with ``Average``, multiply by ``1/f`` before the sum and by
            ``f/size`` after it.
        num_groups: Horovod's older spelling of ``groups=k`` (deprecated there too).
        groups: an int ``k`` (the parameters split into ``k`` contiguous groups) or a list of
            lists of parameters; each group's gradients are reduced together as one grouped
            allreduce once all of them are ready (see :mod:`hvd_trainer.torch.groups`). The
            parameters in no group are bucketed as without groups. ``None``/``0``: no groups.
        sparse_as_dense: reduce sparse gradients as dense tensors (allreduce) instead of by
            allgather of indices and values.
        sparse: Horovod 0.21's flag (``True``, ``False`` or a dict of parameter to bool; later
            replaced by ``sparse_as_dense``), accepted with its behaviour there: a sparse
            gradient travels sparse (allgather), a dense one dense, whatever it says; with
            ``sparse_as_dense=True`` it must not ask for sparse.
        process_set: the comm layer's process set to reduce over (``None`` = all ranks).
        zero_stage: ``0`` (default): every rank keeps the whole optimizer state. ``1``: the
            optimizer state is sharded: each parameter is owned by one rank, which alone steps
            it and keeps its state; updated parameters are then exchanged. ``2``: also the
            gradients: buckets are reduce-scattered, so after ``synchronize()`` only owned
            parameters have a ``.grad`` (the others ``None``). See :mod:`hvd_trainer.comm.zero`
            and :mod:`hvd_trainer.torch.zero_optimizer` (clipping: :meth:`clip_grad_norm_`;
            checkpoints: :meth:`consolidate_state_dict`).
        zero_overlap_exchange: with ``zero_stage`` 1 or 2, leave the exchange of updated
            parameters running after ``step()`` and finish each bucket just before the first
            module holding one of its parameters runs its next forward, so the transfer
            overlaps the forward pass (on a slow link it otherwise follows the step, exposed).
            Parameters of other owners hold their old values until then: code that reads them
            outside a module's own forward (``model.state_dict()`` right after ``step()``, a
            functional call on another module's weight) calls
            :meth:`finish_parameter_exchange` first. Default ``False``.
        fusion_config: bucket sizes for the reducer (bytes).
        world: the world to reduce over (default: ``hvd_trainer.get_world()``).

    Raises:
        OptimizerConfigError: invalid ``named_parameters``, ``compression``,
            ``backward_passes_per_step`` (``True`` included), ``op`` (an unknown string
            included), ``gradient_predivide_factor`` or ``sparse``; an option the comm layer
            lacks; a combination that does not run
            (:class:`~hvd_trainer.comm.sync_options.SyncOptions`, the same checks as
            ``HorovodStrategy`` and the Keras optimizer): ``op=Adasum`` with ZeRO, an
            error-feedback compression or ``"auto"``; ZeRO with ``groups``, ``"auto"`` or an
            error-feedback compression (stage 2: or fp16).
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        NotInitializedError: ``hvd_trainer.init()`` has not run.
    """

    # GradScaler must unscale through ``param_groups`` (which finishes the reduction) and not
    # hand its scale to a fused inner step via attributes set on this wrapper. (A torch private:
    # comm/base/_torch_compat.AMP_SCALING_FLAG, checked in tests/unit/test_compat.py.)
    _step_supports_amp_scaling = False

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        compression: Compressor | type[Compressor] | str | None = Compression.none,
        backward_passes_per_step: int = 1,
        op: ReduceOp | str | None = Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
        sparse_as_dense: bool = False,
        process_set: Any = None,
        *,
        zero_stage: int = 0,
        zero_overlap_exchange: bool = False,
        fusion_config: FusionConfig | None = None,
        world: World | None = None,
        sparse: bool | dict[Any, bool] | None = None,
    ) -> None:
        _check_sparse_arg(sparse, sparse_as_dense)
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer; wrap it only once.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        self._inner = optimizer
        self._named = _resolve_named(optimizer, named_parameters)
        self._groups = resolve_groups([(n, p) for n, p in self._named if p.requires_grad],
                                      num_groups, groups, OptimizerConfigError)
        # the option matrix, checked before any hook is added
        opts = SyncOptions.check(
            error=OptimizerConfigError, compression=compression, op=op,
            backward_passes_per_step=backward_passes_per_step,
            gradient_predivide_factor=gradient_predivide_factor, zero_stage=zero_stage,
            zero_overlap_exchange=zero_overlap_exchange, groups=bool(self._groups), allow_adasum=True,
        )
        self._opts = opts
        self._sync = GradientSync(opts, world=world, process_set=process_set, fusion=fusion_config)
        self._op = opts.op
        self._names = {id(p): n for n, p in self._named}
        self._bpps = opts.backward_passes_per_step
        self._predivide = opts.gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        if world is None:
            get_world()  # NotInitializedError now, not at the first step
        # torch.optim.Optimizer bookkeeping (hook tables, profiled step); its __init__ is not
        # called because the parameters, state and defaults are the inner optimizer's.
        init_optimizer_bookkeeping(self)
        self._reducer_ids: set[int] = set()  # the dense parameters the reducer holds
        self._sparse: list[tuple[str, torch.Tensor]] = []
        self._sparse_dims: dict[int, int] = {}
        self._densified: set[int] = set()
        self._counts: dict[int, int] = {}
        self._due = False  # a reduction is due (some parameter reached its last pass)
        self._synced = False  # gradients of this step are reduced
        self._user_synced = False
        self._skip = False
        # Reduced: what required grad at construction (Horovod registers its hooks then), even
        # if frozen when the first synchronize() builds the buckets; and what is unfrozen later.
        self._hooks: list[Any] = []
        self._trainable_ids: set[int] = set()
        for _, p in self._named:
            if p.requires_grad:
                self._track(p)
        self._zero: ZeroSharding | None = self._sync.shard(self._named, self._inner)
        self._zero_world: World | None = self._world if self._zero is not None else None
        self._zero_needs_state = False  # shards planned again for a new world, nothing loaded yet

    # -- delegation ---------------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's ``param_groups``. Finishes a due gradient reduction first."""
        if self._due:
            self._synchronize()
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's per-parameter state."""
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's default hyperparameters."""
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner.defaults = value

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's ``state_dict()`` (loadable without hvd_trainer). With
        error-feedback compression (``int8``, ``powersgd``) it also holds this rank's residuals
        (and PowerSGD's Q) under the key ``"hvd_trainer"`` (``{"compression": ...}``).

        With ``zero_stage`` 1 or 2: the full state gathered by :meth:`consolidate_state_dict`
        on this rank (``CommValueError`` if it was not)."""
        if self._zero is not None:
            return self._zero.state_dict()
        state = self._inner.state_dict()
        compression = self._sync.compression_state_dict()
        if compression is not None:
            state = {**state, EXTRA_STATE_KEY: {"compression": compression}}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load into the inner optimizer (and the error-feedback state, when saved) and reset the
        backward-pass counters.

        With ``zero_stage`` 1 or 2, ``state_dict`` is a full state (from
        :meth:`consolidate_state_dict`, saved at any number of ranks, or from a plain torch
        optimizer); each rank keeps its own parameters' part. Every rank loads the same one."""
        self._check_not_due("load_state_dict()")
        if self._zero is not None:
            self._zero.load_state_dict(self._inner, state_dict)
            self._zero_needs_state = False
            self._reset_counts()
            return
        state_dict = dict(state_dict)
        extra = state_dict.pop(EXTRA_STATE_KEY, None) or {}
        self._inner.load_state_dict(state_dict)
        if extra.get("compression") is not None:
            self._sync.load_compression_state_dict(extra["compression"])
        self._reset_counts()

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """ZeRO: gather the sharded optimizer state on rank ``to`` (``None``: on every rank; a
        collective: every rank calls it); then ``state_dict()`` there is the full state a plain
        torch optimizer loads. Without ZeRO: nothing to gather (``state_dict()`` is full
        everywhere)."""
        if self._zero is not None:
            self._follow_world()
            self._zero.consolidate(self._inner, to)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the averaged gradients by their global norm (call after :meth:`synchronize`);
        returns the total norm, as ``torch.nn.utils.clip_grad_norm_`` over all parameters.

        Needed with ``zero_stage=2``, where a rank holds only its parameters' gradients (one
        8-byte allreduce combines the shards' norms); with stage 0 and 1 it equals torch's
        function over the optimizer's parameters, which works there too."""
        if self._zero is not None:
            return self._zero.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        params = [p for group in self._inner.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)

    @property
    def zero_stage(self) -> int:
        """0, 1 or 2."""
        return 0 if self._zero is None else self._zero.stage

    @property
    def zero_sharding(self) -> ZeroSharding | None:
        """The ZeRO ownership plan and logic (``None`` with ``zero_stage=0``)."""
        return self._zero

    def add_param_group(self, param_group: dict[str, Any]) -> None:  # type: ignore[override]
        """Add a group to the inner optimizer; its parameters are reduced from the next step
        on (every rank must add the same group)."""
        self._check_not_due("add_param_group()")
        if self._zero is not None:
            raise OptimizerConfigError(
                "add_param_group() with zero_stage>0: the shard plan covers the parameters given "
                "at construction. HINT: put every parameter group into the optimizer before "
                "wrapping it."
            )
        self._inner.add_param_group(param_group)
        g = len(self._inner.param_groups) - 1
        for i, p in enumerate(self._inner.param_groups[g]["params"]):
            if id(p) in self._names:
                continue
            self._names[id(p)] = f"param_group{g}.param{i}"
            self._named.append((self._names[id(p)], p))
            if p.requires_grad:
                self._track(p)
        self._drop_reducer()

    def _drop_reducer(self) -> None:
        """Release the reducer (its bytes and feedback state kept); the next ``synchronize()``
        builds one again."""
        self._sync.release()
        self._reducer_ids = set()

    def _track(self, p: torch.Tensor) -> None:
        """Count ``p``'s backward passes and reduce its gradient from the next build on."""
        self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._trainable_ids.add(id(p))

    def _adopt_unfrozen(self) -> None:
        """Parameters frozen at construction that have a gradient now (unfrozen since): hooked,
        and the buckets built again with them at this ``synchronize()`` (which then reduces the
        gradients backward left in ``.grad``).

        Raises:
            OptimizerConfigError: with ``zero_stage``, whose plan covers the parameters trainable
                at construction.
        """
        new = [(n, p) for n, p in self._named
               if id(p) not in self._trainable_ids and p.requires_grad and p.grad is not None]
        if not new:
            return
        if self._zero is not None:
            raise OptimizerConfigError(
                f"zero_stage={self._zero.stage}: {[n for n, _ in new][:3]} were frozen at "
                "construction and have gradients now, but the shard plan covers the parameters "
                "trainable at construction. HINT: unfreeze before wrapping the optimizer, or use "
                "zero_stage=0 with parameters unfrozen during training."
            )
        for _, p in new:
            self._track(p)
        self._drop_reducer()

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally: expose the inner optimizer's extras.
        if name.startswith("__") or name == "_inner" or "_inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._inner!r})"

    # -- gradient hooks -----------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        self._follow_world()
        count = self._counts.get(id(p), 0) + 1
        if count > self._bpps:
            raise GradientSyncError(
                f"gradient of {self._names[id(p)]!r} was computed {count} times since the last "
                f"step(), but backward_passes_per_step={self._bpps}. HINT: call step() (or "
                "synchronize()) after every backward_passes_per_step backward passes, or raise "
                "backward_passes_per_step."
            )
        self._counts[id(p)] = count
        # New gradients: a synchronize() whose step() never ran (e.g. GradScaler found inf)
        # does not cover them.
        self._synced = self._user_synced = False
        if p.grad is not None and p.grad.is_sparse:
            self._on_sparse_grad(p)
        if count == self._bpps:
            self._due = True
        if count == self._bpps and self._reducer is not None and id(p) in self._reducer_ids:
            self._reducer.grad_ready(p)  # this hook is the reducer's too: one per parameter

    def _on_sparse_grad(self, p: torch.Tensor) -> None:
        self._sparse_dims[id(p)] = p.grad.sparse_dim()
        if self._sparse_as_dense or id(p) in self._reducer_ids:
            if not self._sparse_as_dense:
                warnings.warn(
                    f"{self._names[id(p)]!r} produced its first sparse gradient after the "
                    "reducer was built; it is reduced as a dense tensor from now on.",
                    stacklevel=2,
                )
            self._densified.add(id(p))
            p.grad = p.grad.to_dense()

    # -- reduction ----------------------------------------------------------------------------
    def _agree_sparse(self, trainable: list[tuple[str, torch.Tensor]]) -> set[int]:
        """Ids of parameters that produced a sparse gradient on any rank."""
        if self._sparse_as_dense:
            return set()
        local = [id(p) in self._sparse_dims for _, p in trainable]
        if self._process_set is not None:
            if any(local):
                raise OptimizerConfigError(
                    "sparse gradients with process_set need sparse_as_dense=True. "
                    "HINT: DistributedOptimizer(..., sparse_as_dense=True)."
                )
            return set()
        flags = torch.tensor([int(x) for x in local] or [0], dtype=torch.int32)
        flags = allreduce(flags, op=Max, world=self._world)
        return {id(p) for (_, p), f in zip(trainable, flags.tolist(), strict=False) if f}

    @property
    def _reducer(self) -> GradientReducer | ReducerSet | None:
        return self._sync.reducer

    def _auto_step_end(self) -> None:
        """After a step while ``"auto"`` measures: count it; when it chose a compressor, the
        buckets are built again with it at the next ``synchronize()``."""
        if self._sync.step_end() is not None and self._sync.reducer is None:
            self._reducer_ids = set()

    @property
    def compression(self) -> Compressor:
        """The compressor in use (``Compression.none`` while ``"auto"`` measures)."""
        return self._sync.compression

    def _build_reducer(self) -> None:
        """Build the reducer over the dense parameters that required grad at construction (or
        were added with a param group), frozen or not, once every rank agreed which are sparse."""
        trainable = [(n, p) for n, p in self._named if id(p) in self._trainable_ids]
        sparse_ids = self._agree_sparse(trainable)
        self._sparse = [(n, p) for n, p in trainable if id(p) in sparse_ids]
        dense = [(n, p) for n, p in trainable if id(p) not in sparse_ids]
        for _, p in dense:
            if p.grad is not None and p.grad.is_sparse:  # sparse_as_dense, first step
                p.grad = p.grad.to_dense()
        self._reducer_ids = {id(p) for _, p in dense}
        if dense:
            self._sync.start_auto(sum(p.numel() * 4 for _, p in dense), dense[0][1].device)
        sharded = self._zero is not None and self._zero.stage == 2 and self._zero.active
        if sharded and self._sparse:
            raise OptimizerConfigError(
                f"zero_stage=2 reduces dense buckets, but {[n for n, _ in self._sparse][:3]} "
                "produced sparse gradients. HINT: DistributedOptimizer(..., sparse_as_dense=True)."
            )
        groups = [[(n, p) for n, p in g if id(p) in self._reducer_ids] for g in self._groups]
        self._sync.build(dense, op=self._op, prescale_factor=1.0 / self._predivide,
                         postscale_factor=self._predivide, groups=groups, sharded=sharded,
                         register_hooks=False,  # _on_grad hands each gradient over
                         **({"plan": self._zero.plan} if sharded else {}))

    def _reduce_sparse(self) -> None:
        for _, p in self._sparse:
            grad = p.grad
            if grad is not None and not grad.is_sparse:
                raise GradientSyncError(
                    f"{self._names[id(p)]!r} had a sparse gradient before but now a dense one. "
                    "HINT: use sparse_as_dense=True for parameters whose gradient layout changes."
                )
            p.grad = sparse_allreduce(
                grad,
                like=p,
                sparse_dim=self._sparse_dims.get(id(p), 1),
                op=self._op,
                prescale_factor=1.0 / self._predivide,
                postscale_factor=self._predivide,
                world=self._world,
            )

    @property
    def _world(self) -> World:
        """The world passed in, else the current one (which in-process recovery replaces)."""
        return self._sync.world

    def _follow_world(self) -> None:
        """After in-process recovery replaced the current world: drop the reducer built for the
        old one (its hooks and its broken in-flight work) and this step's pending counts; the
        next synchronize() builds a reducer over the new world. With ZeRO the shards are planned
        again for the new world; the state of the parameters this rank now owns comes from the
        next :meth:`load_state_dict` (``elastic.TorchState`` restores or syncs a full commit)."""
        world = self._world
        if self._zero is not None and self._zero_world is not world:
            self._zero.abandon_exchange()  # its transfers ran on the old world's groups
            self._zero.restore_param_groups()
            self._zero = self._sync.shard(self._named, self._inner)
            self._zero_world, self._zero_needs_state = world, True
        if not self._sync.follow_world():
            return
        self._reducer_ids = set()
        self._counts.clear()
        self._due = self._synced = self._user_synced = False

    def _synchronize(self) -> None:
        self._follow_world()
        if self._zero_needs_state:
            raise CommValueError(
                "zero_stage: the world changed (in-process recovery) and the shards were planned "
                "again, but no optimizer state was loaded for the parameters this rank now owns. "
                "HINT: keep the optimizer in hvd_trainer.elastic.TorchState(model, optimizer) "
                "under @elastic.run, which restores it from the last commit."
            )
        if self._op is ReduceOp.ADASUM:  # gradients stay local; step() combines weight changes
            self._reset_counts()
            self._synced = True
            return
        self._adopt_unfrozen()
        if self._reducer is None:
            self._build_reducer()
        assert self._reducer is not None
        try:
            with self._sync.waiting():
                self._reducer.wait()
        except BaseException:
            self._reset_counts()  # the reducer dropped this step's work: zero_grad() may follow
            raise
        if self._zero is not None:
            self._zero.after_reduction(self._reducer)
        self._reduce_sparse()
        for _, p in self._named:
            if id(p) in self._densified and p.grad is not None:
                p.grad = p.grad.to_sparse(self._sparse_dims[id(p)])
        self._reset_counts()
        self._synced = True

    def _reset_counts(self) -> None:
        self._counts.clear()
        self._due = False
        if self._reducer is not None:
            self._reducer.require_sync = True

    def _check_not_due(self, what: str) -> None:
        self._follow_world()  # a step cut short by a lost rank is not due in the new world
        if self._due:
            raise GradientSyncError(
                f"{what} was called while the gradients of this step are being averaged across "
                "ranks. HINT: call optimizer.step() (or optimizer.synchronize()) after "
                "backward() and before zero_grad()."
            )

    # -- public API ---------------------------------------------------------------------------
    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """Reduce each gradient bucket with a DDP-style communication hook instead of the
        built-in allreduce (``DistributedDataParallel.register_comm_hook``'s contract, so the
        hooks of ``torch.distributed.algorithms.ddp_comm_hooks`` run unchanged).

        ``hook(state, bucket)`` is called once per bucket while backward runs, with
        ``bucket.buffer()`` the flattened local gradients (summed over
        ``backward_passes_per_step``; times ``1/gradient_predivide_factor``), and returns a
        ``torch.futures.Future`` of the averaged buffer; :meth:`synchronize` waits for it (then
        multiplies by ``gradient_predivide_factor``). Every rank registers the same hook (checked
        with each bucket's layout on the first step), before a step or between steps; registering
        again replaces it. The hook's state (PowerSGD's error buffers) is not in
        :meth:`state_dict`, as in DDP. Sparse gradients are still allgathered. A parameter no
        rank produced a gradient for gets the hook's result (zeros for an averaging hook, as in
        Horovod; DDP leaves it ``None``), so weight decay or momentum still move it. See
        :mod:`hvd_trainer.comm.reduce.bucket_hooks`.

        Example:
            >>> from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
            >>> opt.register_comm_hook(powerSGD.PowerSGDState(process_group=None,
            ...     matrix_approximation_rank=2, start_powerSGD_iter=10), powerSGD.powerSGD_hook)

        Raises:
            OptimizerConfigError: ``hook`` is not callable; with a ``compression`` (or
                ``"auto"``), ``op`` other than Average, ``zero_stage`` or ``groups``; a
                ``PostLocalSGDState`` (its model averager is not run).
            GradientSyncError: called while a step's gradients are being reduced.
        """
        if not callable(hook):
            swapped = " The arguments are (state, hook), as in DDP." if callable(state) else ""
            raise OptimizerConfigError(
                f"register_comm_hook(state, hook): hook={hook!r:.80} is not callable.{swapped} HINT: "
                "pass a function hook(state, bucket) -> torch.futures.Future, e.g. "
                "register_comm_hook(None, torch.distributed.algorithms.ddp_comm_hooks.default_hooks."
                "allreduce_hook)."
            )
        self._opts.refuse_comm_hook("register_comm_hook()", groups=bool(self._groups), state=state)
        self._follow_world()
        if self._due:
            raise GradientSyncError(
                "register_comm_hook() was called between backward() and step(), while this step's "
                "gradients are being reduced. HINT: register the hook before the first backward(), "
                "or after a step()."
            )
        self._sync.comm_hook = (state, hook)
        self._drop_reducer()

    def finish_parameter_exchange(self) -> None:
        """With ``zero_overlap_exchange=True``: finish the exchange of updated parameters that
        the last ``step()`` left running (every rank, at the same point); afterwards every
        parameter holds its owner's update. A no-op otherwise."""
        if self._zero is not None:
            self._zero.finish_exchange()

    def synchronize(self) -> None:
        """Finish averaging the gradients of this step; afterwards every ``p.grad`` holds the
        average (or sum) over ranks. Every rank must call it (it is a collective).

        A parameter without a gradient on this rank contributes zeros, so no rank hangs.
        """
        self._synchronize()
        self._user_synced = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside does not synchronize; use after an explicit :meth:`synchronize`.
        Restores the previous setting on exit, so it nests."""
        previous = self._skip
        self._skip = True
        try:
            yield
        finally:
            self._skip = previous

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Synchronize (unless done already or skipped), then step the inner optimizer.

        ``closure`` (as ``torch.optim.LBFGS`` needs: it zeroes the gradients, runs backward and
        returns the loss) is wrapped so that each evaluation is distributed: the gradients its
        backward computes are averaged (or summed) before the inner optimizer reads them, and
        the loss it returns is averaged (or summed, with ``op=Sum``) over the ranks, in its own
        shape and dtype (a float when the closure returned a number). So the inner optimizer
        sees the global objective on every rank and takes the same decisions (LBFGS's line
        search and stopping tests), and every rank evaluates the closure the same number of
        times. Horovod passes the closure through, so there its gradients stay local and ranks
        drift apart.

        Returns:
            What the inner ``step`` returns (with a closure: the combined loss of its first
            evaluation, as torch's optimizers return it).

        Raises:
            OptimizerConfigError: a ``closure`` with ``op=Adasum`` (Adasum combines weight
                changes of one local step; pass no closure).
            GradientSyncError: inside ``skip_synchronize()`` without a prior ``synchronize()``.
        """
        if closure is not None and self._op is ReduceOp.ADASUM:
            raise OptimizerConfigError(
                "DistributedOptimizer(op=Adasum).step() does not take a closure: Adasum combines "
                "the weight changes of one local step. HINT: run backward() before step() and "
                "call step() without a closure."
            )
        if self._user_synced and not self._skip:
            warnings.warn(
                "optimizer.step() called without optimizer.skip_synchronize() after "
                "optimizer.synchronize(); the gradients are not reduced again. HINT: wrap step() "
                "in `with optimizer.skip_synchronize():`.",
                UserWarning,
                stacklevel=2,
            )
        if self._skip and self._due:
            raise GradientSyncError(
                "step() inside skip_synchronize() while the gradients of this step are still "
                "being averaged. HINT: call optimizer.synchronize() before entering "
                "skip_synchronize()."
            )
        if not self._skip and not self._synced and (closure is None or self._backward_on_any_rank()):
            self._synchronize()  # with a closure: only when a backward ran before step()
        self._synced = False
        self._user_synced = False
        if self._op is ReduceOp.ADASUM:
            params = [p for _, p in self._named if p.requires_grad]
            return adasum_step(self._inner, params, compression=self._sync.compression,
                               process_set=self._process_set, world=self._world)
        distributed = self._distributed_closure(closure) if closure is not None else None
        if self._zero is not None:
            return self._zero.step(self._inner, distributed)
        out = self._inner.step(distributed) if distributed is not None else self._inner.step()
        self._auto_step_end()  # ZeRO and Adasum refuse or never resolve "auto"
        return out

    def _backward_flag(self) -> torch.Tensor:
        """1.0 when a backward pass ran on this rank since the last reset, else 0.0 (float64)."""
        return torch.tensor([1.0 if self._counts else 0.0], dtype=torch.float64)

    def _backward_on_any_rank(self) -> bool:
        """Whether a backward pass ran since the last step on some rank (a collective)."""
        return bool(allreduce(self._backward_flag(), op=Max, name="hvd.closure_backward",
                              process_set=self._process_set, world=self._world).item() > 0)

    def _distributed_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` whose gradients are reduced and whose loss is combined over the ranks.

        One small allreduce per evaluation carries the loss and whether a backward ran (a
        closure that only returns the loss computes no gradients, and the ones already reduced
        must not be reduced again); the gradient buckets follow when one did.
        """

        # The loss is combined like the gradients: averaged for Average, summed for Sum, so
        # the line search sees the loss of the objective whose gradient it gets.
        op = Sum if self._op is ReduceOp.SUM else Average

        def evaluate() -> Any:
            with torch.enable_grad():  # torch's optimizers call the closure under no_grad
                loss = closure()
            if isinstance(loss, torch.Tensor):
                values = loss.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
            else:
                values = torch.tensor([0.0 if loss is None else float(loss)], dtype=torch.float64)
            both = allreduce(torch.cat([values, self._backward_flag()]), op=op, name="hvd.closure_loss",
                             process_set=self._process_set, world=self._world)
            if both[-1].item() > 0:  # some rank's closure ran backward
                self._synchronize()
                self._synced = False
            if loss is None:
                return None
            if isinstance(loss, torch.Tensor):
                return both[:-1].reshape(loss.shape).to(device=loss.device, dtype=loss.dtype)
            return float(both[0])

        return evaluate

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (inner ``zero_grad``) and restart backward-pass counting.

        Raises:
            GradientSyncError: the gradients of this step are still being reduced.
        """
        self._check_not_due("zero_grad()")
        if self._zero is not None:
            self._zero.restore_param_groups()
        self._inner.zero_grad(set_to_none=set_to_none)
        self._reset_counts()
        self._synced = self._user_synced = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step`` (between steps)."""
        check_backward_passes_per_step(passes, error=OptimizerConfigError)
        self._check_not_due("set_backward_passes_per_step()")
        self._bpps = passes

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated locally per step."""
        return self._bpps

    @property
    def wire_bytes_sent(self) -> int:
        """Bytes this rank has sent for dense gradient buckets so far (see
        :attr:`hvd_trainer.comm.GradientReducer.wire_bytes_sent`; ZeRO-2's reduce-scatter
        included; sparse gradients and ZeRO's parameter exchange after the step not counted)."""
        return self._sync.wire_bytes_sent

    @property
    def op(self) -> ReduceOp:
        """``Average``, ``Sum`` or ``Adasum``."""
        return self._op

    def remove_hooks(self) -> None:
        """Unregister every gradient hook (the optimizer then no longer reduces)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._sync.release()


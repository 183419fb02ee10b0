"""The gradient reduction every front end drives: :class:`GradientSync`.

The torch ``DistributedOptimizer``, ``HorovodStrategy`` and the Keras ``DistributedOptimizer``
(torch backend) each hold one. It owns what their reductions share:

- the bucket reducer over the parameters the front end names (a
  :class:`~hvd_trainer.comm.reduce.fusion.GradientReducer`, ZeRO stage 2's
  :class:`~hvd_trainer.comm.zero.reducer.ShardedGradientReducer`, or a :class:`ReducerSet` of
  explicit groups), built with the options checked once by
  :class:`~hvd_trainer.comm.sync_options.SyncOptions`, and the bytes sent by the reducers it
  replaced;
- the wire compression, ``"auto"`` resolved here (:class:`~hvd_trainer.comm.reduce.auto.AutoMode`,
  announced on rank 0 the same way for every front end), and with ``sync_every="auto"`` the local
  steps it chose;
- the error-feedback state (``int8``, PowerSGD): kept across a rebuilt reducer, and loadable
  before the first reducer exists;
- the world it reduces over: the one passed in, else the current one, which in-process recovery
  replaces (:meth:`GradientSync.follow_world`).

The front end keeps what needs its framework: which parameters, when a backward pass counts, the
optimizer step and its state dict.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hvd_trainer.comm.ops.ops import ReduceOp
from hvd_trainer.comm.ops.process_set import resolve_set
from hvd_trainer.comm.reduce.auto import AutoChoice, AutoMode
from hvd_trainer.comm.reduce.compressed.reductions import merge_feedback
from hvd_trainer.comm.reduce.fusion import FusionConfig, GradientReducer
from hvd_trainer.comm.sync_options import SyncOptions
from hvd_trainer.comm.world.world import World, get_world
from hvd_trainer.comm.zero.plan import ShardPlan
from hvd_trainer.comm.zero.reducer import ShardedGradientReducer, stage2_config
from hvd_trainer.comm.zero.sharding import ZeroSharding

__all__ = ["GradientSync", "ReducerSet", "ONE_BUCKET"]

Named = Sequence[tuple[str, torch.Tensor]]

ONE_BUCKET = FusionConfig(fusion_threshold_bytes=2**62, first_bucket_bytes=2**62, autotune=None)
"""Bucket caps no group reaches: a group is one bucket per (device, dtype)."""


class ReducerSet:
    """Several :class:`~hvd_trainer.comm.GradientReducer` driven as one (explicit groups, then
    the parameters in no group), with a reducer's interface."""

    def __init__(self, reducers: list[GradientReducer]) -> None:
        self.reducers = reducers
        self._by_param = {id(p): r for r in reducers for _, p in r.named_parameters}

    def grad_ready(self, param: torch.Tensor) -> None:
        """Hand ``param``'s accumulated gradient to the reducer holding it."""
        self._by_param[id(param)].grad_ready(param)

    @property
    def require_sync(self) -> bool:
        """Whether backward passes send (``False``: they accumulate locally), every reducer's."""
        return all(r.require_sync for r in self.reducers)

    @require_sync.setter
    def require_sync(self, value: bool) -> None:
        for r in self.reducers:
            r.require_sync = value

    def wait(self) -> None:
        """Finish every reducer's reduction of this step (in creation order, on every rank)."""
        for r in self.reducers:
            r.wait()

    @property
    def wire_bytes_sent(self) -> int:
        """Bytes sent by every reducer (:attr:`GradientReducer.wire_bytes_sent`)."""
        return sum(r.wire_bytes_sent for r in self.reducers)

    def compression_state_dict(self) -> dict[str, Any] | None:
        """The reducers' error-feedback states merged (parameter names are unique)."""
        states = [s for r in self.reducers if (s := r.compression_state_dict()) is not None]
        return merge_feedback(states) if states else None

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        """Give each reducer its parameters' entries of ``state``.

        Raises:
            ValueError: the reducers' compression keeps no such state.
        """
        for r in self.reducers:
            r.load_compression_state_dict(state)

    def remove(self) -> None:
        """Unregister every reducer's hooks."""
        for r in self.reducers:
            r.remove()


Reducer = GradientReducer | ReducerSet


class GradientSync:
    """One front end's gradient reduction (the module docstring says what it owns).

    Args:
        opts: the options as checked (:meth:`SyncOptions.check`).
        world: the world to reduce over, or a function returning it (looked up at each use);
            ``None``: the current one (:func:`~hvd_trainer.comm.get_world`).
        process_set: reduce over these ranks only (``None``: the whole world).
        fusion: bucket sizes (``None``: :class:`~hvd_trainer.comm.FusionConfig`'s defaults).

    Attributes:
        reducer: the reducer now built (``None`` before :meth:`build` and after :meth:`release`).
        compression: the compressor in use (``Compression.none`` while ``"auto"`` measures).
        local: the local-steps outer loop's settings (given, or chosen by ``sync_every="auto"``),
            else ``None``.
        comm_hook: ``(state, hook)``, a DDP-style communication hook the next :meth:`build` uses.
    """

    def __init__(self, opts: SyncOptions, *, world: World | Callable[[], World] | None = None,
                 process_set: Any = None,
                 fusion: FusionConfig | None = None) -> None:
        self.opts = opts
        self._world = world
        self.process_set = process_set
        self.fusion = fusion
        self.comm_hook: tuple[Any, Any] | None = None
        self.compression = opts.compression
        self.local = opts.local
        self.reducer: Reducer | None = None
        self._auto: AutoMode | None = None
        self._auto_world: World | None = None  # the world "auto" measures in
        self._built_for: World | None = None
        self._released_bytes = 0
        self._feedback: dict[str, Any] | None = None  # loaded or carried, for the next reducer

    # -- the world ----------------------------------------------------------------------------
    @property
    def world(self) -> World:
        """The world passed in (or its function's), else the current one (which in-process
        recovery replaces)."""
        if self._world is None:
            return get_world()
        return self._world if isinstance(self._world, World) else self._world()

    def follow_world(self) -> bool:
        """After in-process recovery replaced the current world: release the reducer built for
        the old one (its hooks and broken in-flight work; its error-feedback state is kept for
        the next :meth:`build`) and measure ``"auto"`` again if it had not chosen (its process
        set was the old world's). Returns whether the reducer was released."""
        world = self.world
        if self.auto_measuring and self._auto_world is not world:
            self._auto = None
        if self.reducer is None or self._built_for is world:
            return False
        self.release()
        return True

    # -- the reducer --------------------------------------------------------------------------
    def build(self, named: Named, *, op: ReduceOp | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, groups: Sequence[Named] = (), sharded: bool = False,
              register_hooks: bool = True, feedback: dict[str, Any] | None = None, **zero: Any) -> Reducer:
        """Build the reducer over ``named`` (releasing the one before), with this object's
        world, compression, process set, fusion config and communication hook.

        Args:
            named: ``(name, parameter)`` pairs, the same on every rank, all reduced: one frozen
                now (``requires_grad=False``, e.g. by Lightning's ``toggle_optimizer``) gets its
                hook while briefly unfrozen, so it is reduced again once unfrozen.
            op: ``Average``, ``Sum`` or ``Adasum`` (default: the options' op).
            prescale_factor, postscale_factor: the reducer's factors.
            groups: explicit groups, each reduced as one bucket (the parameters of ``named`` in
                no group are bucketed by the fusion config); a :class:`ReducerSet` is built.
            sharded: ZeRO stage 2: reduce-scatter to the owners
                (:class:`~hvd_trainer.comm.zero.reducer.ShardedGradientReducer`); ``zero`` holds
                its ``plan=`` or ``split=``.
            register_hooks: ``False``: the caller's hook calls ``grad_ready`` (see
                :class:`~hvd_trainer.comm.GradientReducer`).
            feedback: error-feedback state to load into the new reducer (default: the one
                :meth:`load_compression_state_dict` loaded, or the released reducer's).

        Returns:
            The reducer (also :attr:`reducer`).

        Raises:
            ValueError: the reducer's own checks (duplicate names, a bad op or hook).
        """
        self.release()
        feedback = self._feedback if feedback is None else feedback
        frozen = [p for _, p in named if not p.requires_grad]
        for p in frozen:  # the reducer skips (registers no hook on) what does not require grad
            p.requires_grad_(True)
        try:
            reducer = self._make(named, op, prescale_factor, postscale_factor, groups, sharded,
                                 register_hooks, zero)
        finally:
            for p in frozen:
                p.requires_grad_(False)
        if feedback is not None and self.compression.error_feedback:
            reducer.load_compression_state_dict(feedback)
        self._feedback = None
        self.reducer, self._built_for = reducer, self.world
        return reducer

    def _make(self, named: Named, op: ReduceOp | None, prescale_factor: float, postscale_factor: float,
              groups: Sequence[Named], sharded: bool, register_hooks: bool, zero: dict[str, Any]) -> Reducer:
        if op is None:
            op = self.opts.op
        kwargs: dict[str, Any] = dict(world=self.world, op=op, compression=self.compression,
                                      prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                      process_set=self.process_set, register_hooks=register_hooks)
        if sharded:
            reducer: Reducer = ShardedGradientReducer(named, config=self.fusion, **kwargs, **zero)
        elif groups:
            grouped = [list(g) for g in groups if g]
            in_group = {id(p) for g in grouped for _, p in g}
            rest = [(n, p) for n, p in named if id(p) not in in_group]
            parts = [(g, ONE_BUCKET) for g in grouped] + ([(rest, self.fusion)] if rest else [])
            reducer = ReducerSet([GradientReducer(part, config=config, comm_hook=self.comm_hook, **kwargs)
                                  for part, config in parts])
        else:
            reducer = GradientReducer(named, config=self.fusion, comm_hook=self.comm_hook, **kwargs)
        return reducer

    def release(self) -> None:
        """Remove the reducer's hooks and drop it, keeping the bytes it sent
        (:attr:`wire_bytes_sent`) and its error-feedback state (for the next :meth:`build`)."""
        reducer, self.reducer = self.reducer, None
        if reducer is None:
            return
        reducer.remove()
        self._released_bytes += reducer.wire_bytes_sent
        self._feedback = reducer.compression_state_dict()

    @property
    def wire_bytes_sent(self) -> int:
        """Bytes this rank has sent for gradient buckets so far (every reducer this object built,
        plus what :meth:`count_sent` added), counted as
        :attr:`~hvd_trainer.comm.GradientReducer.wire_bytes_sent` counts them."""
        return self._released_bytes + (0 if self.reducer is None else self.reducer.wire_bytes_sent)

    def count_sent(self, nbytes: int) -> None:
        """Add ``nbytes`` sent outside the reducer (a front end's own gradient path) to
        :attr:`wire_bytes_sent`."""
        self._released_bytes += nbytes

    # -- ZeRO ---------------------------------------------------------------------------------
    def shard(self, named: Named, optimizer: torch.optim.Optimizer, *,
              plan: ShardPlan | None = None) -> ZeroSharding | None:
        """ZeRO (the options' ``zero_stage`` 1 or 2): which rank owns which parameter, or piece
        of one, of ``optimizer`` in this world, and the owned step
        (:class:`~hvd_trainer.comm.zero.ZeroSharding`); ``None`` for stage 0.

        Stage 2 without ``plan``: the bucket caps are first paced to the measured link (a
        collective over the ranks when they span hosts) and kept as :attr:`fusion`, so the
        reducer :meth:`build` makes with ``sharded=True, plan=zero.plan`` has the same buckets.

        Args:
            named: the parameters to shard, the same names in the same order on every rank.
            optimizer: the per-parameter optimizer whose state is sharded.
            plan: the stage-2 reducer's plan (it was built first); ``None``: planned here.

        Raises:
            UnshardableOptimizerError: ``optimizer``'s step is not per parameter.
            CommValueError: ``plan`` covers other parameters or another number of ranks.
        """
        stage = self.opts.zero_stage
        if not stage:
            return None
        world = self.world
        if stage == 2 and plan is None:  # idempotent: a paced config is not probed again
            device = next((p.device for _, p in named), None)
            self.fusion, _ = stage2_config(self.fusion, world, self.process_set, device)
        return ZeroSharding(named, optimizer, stage=stage, world=world, config=self.fusion,
                            process_set=self.process_set,
                            overlap_exchange=self.opts.zero_overlap_exchange, plan=plan)

    # -- error-feedback state -----------------------------------------------------------------
    def compression_state_dict(self) -> dict[str, Any] | None:
        """This rank's error-feedback state (the reducer's, else the one loaded or carried for
        the next reducer), or ``None`` for stateless compression."""
        if not self.compression.error_feedback:
            return None
        return self._feedback if self.reducer is None else self.reducer.compression_state_dict()

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`compression_state_dict`'s output now, or into the next reducer built.

        Raises:
            opts.error: this compression keeps no error-feedback state (the message names the
                compression the state was saved with, and a HINT).
        """
        if not self.compression.error_feedback:
            raise self.opts.error(
                f"the state holds error-feedback state of compression {state.get('compressor')!r}; "
                f"this optimizer uses {self.compression!r}. HINT: resume with the same compression=."
            )
        if self.reducer is None:
            self._feedback = state
        else:
            self.reducer.load_compression_state_dict(state)

    # -- "auto" -------------------------------------------------------------------------------
    @property
    def auto_measuring(self) -> bool:
        """Whether ``"auto"`` is timing steps before it chooses."""
        return self._auto is not None and self._auto.measuring

    def start_auto(self, grad_bytes: int, device: torch.device) -> None:
        """``compression="auto"`` / ``sync_every="auto"``: start choosing, unless nothing is
        ``"auto"`` or the choice is made (a new start while still measuring begins again).
        On one host every rank chooses at once; across hosts the front end trains plain and
        calls :meth:`step_end` after each optimizer step until the choice is made, wrapping its
        waits on gradient communication in :meth:`waiting`. Every rank calls it (a collective
        across hosts, later).

        Args:
            grad_bytes: bytes of one fp32 copy of the gradients reduced per step.
            device: the gradients' device (the link probe's tensors).
        """
        if not self.opts.any_auto or (self._auto is not None and not self._auto.measuring):
            return
        world = self._auto_world = self.world
        self._auto = AutoMode(world, resolve_set(self.process_set, world, "auto"), device, grad_bytes,
                              asked=self.opts.asked)
        if self._auto.choice is not None:
            self._take(self._auto.choice)

    def waiting(self) -> contextlib.AbstractContextManager[None]:
        """Around a wait on gradient communication: timed while ``"auto"`` measures."""
        return self._auto.waiting() if self.auto_measuring else contextlib.nullcontext()

    def step_end(self) -> AutoChoice | None:
        """After an optimizer step while ``"auto"`` measures: count it; at the step that chose,
        take the choice, release a reducer whose compression it changed (the front end builds
        the next one) and return it. Otherwise ``None``."""
        if not self.auto_measuring:
            return None
        assert self._auto is not None
        choice = self._auto.step_end(self.world)
        if choice is None:
            return None
        before = self.compression.name
        self._take(choice)
        if self.compression.name != before or self.local is not None:
            self.release()
        return choice

    def adopt(self, choice: AutoChoice) -> None:
        """Take ``choice`` without measuring (restored from a checkpoint taken after ``"auto"``
        chose); the reducer, if any, is released. Nothing is printed."""
        if self._auto is not None:
            self._auto.adopt(choice)
        self._take(choice)
        self.release()

    def _take(self, choice: AutoChoice) -> None:
        if self.opts.auto_compression:
            self.compression = choice.compression
        if self.opts.auto_sync_every and choice.sync_every is not None:
            self.local = self.opts.local_for(choice.sync_every, self.compression)

    def describe(self) -> str:
        """What runs now: ``"compression=<name>[, sync_every=H]"``."""
        return f"compression={self.compression.name}" + (
            f", sync_every={self.local.sync_every}" if self.local is not None else "")

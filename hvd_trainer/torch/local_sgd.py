"""``hvd.LocalSGD``: DiLoCo-style local steps for plain torch training loops.

Each rank steps its own (inner) optimizer on its own data with no communication; every
``sync_every`` steps the ranks average their parameter change since the last synchronisation
and an outer SGD with Nesterov momentum applies it (:mod:`hvd_trainer.comm.reduce.localsgd.outer` has
the algorithm). Use the plain optimizer inside, not a ``DistributedOptimizer``: no gradient is
reduced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from hvd_trainer.comm import (
    AutoChoice,
    AutoMode,
    Average,
    Compression,
    Compressor,
    LocalSGDConfigError,
    OuterArgs,
    OuterSync,
    ProcessSet,
    World,
    get_world,
    grouped_allreduce_,
    init_optimizer_bookkeeping,
    local_steps_config,
    resolve_set,
)
from hvd_trainer.torch.state_sync import broadcast_parameters

__all__ = ["LocalSGD", "LocalSGDConfigError"]


class LocalSGD(torch.optim.Optimizer):
    """Take ``sync_every`` local steps, then an outer step on the averaged parameter change.

    Example:
        >>> inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> opt = hvd.LocalSGD(inner, model, sync_every=32)   # broadcasts rank 0's parameters
        >>> for x, y in loader:
        ...     opt.zero_grad(); loss_fn(model(x), y).backward()
        ...     opt.step()           # every 32nd call also averages and runs the outer step
        >>> opt.sync()               # at the end: make the ranks' parameters equal

    ``sync_every=1, outer_lr=1.0, outer_momentum=0.0`` with an SGD inner optimizer is
    synchronous data parallel (tested). Construction is a collective: the model's parameters
    are broadcast from rank 0 (the ranks must start from the same anchor).

    ``state_dict()`` is ``{"inner": <inner optimizer's state_dict>, "outer": <anchors, outer
    SGD state, step counters>}``: each rank's own (inner state and parameters between two
    synchronisations are per rank); saving and loading it on every rank, together with the
    model's ``state_dict()``, resumes bit-identically.

    Args:
        optimizer: the inner torch optimizer over ``model``'s parameters (not wrapped in
            ``DistributedOptimizer``).
        model: the module whose parameters are synchronised (all floating ones, frozen included,
            so that parameters unfrozen later stay in step; frozen ones cost bytes, not change).
        sync_every: inner steps per outer step (``H``), or ``"auto"``: chosen from the measured
            link and the step's measured compute, as the Lightning strategy's
            ``sync_every="auto"`` chooses (:mod:`hvd_trainer.comm.reduce.auto`; rank 0 prints the
            choice and why): on one host at construction; across hosts after the first 7
            ``step()`` calls, which are synchronous (below, plain fp32) and timed. While no local
            steps are chosen (one host, a fast link, or still measuring) every ``step()``
            averages the gradients over the ranks first (in the chosen wire format, e.g. bf16)
            and then steps the inner optimizer: synchronous data parallel, ``outer`` is ``None``
            and ``sync_every`` 1. Every parameter that has a gradient on one rank must have one
            on all ranks then. The outer settings below apply when it chooses local steps (the
            outer loop starts from the parameters of that step, equal on every rank).
        outer_lr: outer learning rate (DiLoCo: 0.7).
        outer_momentum: outer momentum (DiLoCo: 0.9).
        nesterov: Nesterov outer momentum (DiLoCo: True).
        compression: wire format of the outer gradient (``None``, ``"fp16"``, ``"bf16"``, or
            ``"int8"``: block-quantised allgather, ~4x fewer bytes at 2 ranks, no error feedback;
            see :mod:`hvd_trainer.comm.reduce.localsgd.outer`).
        overlap_steps: inner steps the outer gradient's allreduce may stay on the wire while
            training goes on (``0 <= overlap_steps < sync_every``; 0, the default, blocks at
            every outer step). Each rank then loads the new anchor plus its own progress since
            the launch (the "hidden outer step" of :mod:`hvd_trainer.comm.reduce.localsgd.outer`);
            not with ``compression="int8"``. With ``fragments``: ``overlap_steps <
            sync_every / fragments``.
        fragments: parts of the parameters (consecutive, of about equal size) with outer steps
            of their own, one part's launched every ``sync_every / fragments`` steps, so each
            outer reduction moves ``1/fragments`` of the bytes (Streaming DiLoCo; the module
            :mod:`hvd_trainer.comm.reduce.localsgd.outer`). Must divide ``sync_every``; 1 (the
            default): all parameters at once. Not with ``sync_every="auto"``.
        sync_warmup_steps: steps at the start each followed by an average of the parameters,
            before local steps begin (``None``: 128; 0: none, e.g. when
            fine-tuning a trained model; the synchronous warm-up of
            :mod:`hvd_trainer.comm.reduce.localsgd.outer`).
        process_set: synchronise over these ranks only (then broadcast the parameters within the
            set yourself first: construction broadcasts only without a process set).
        world: default ``hvd_trainer.get_world()``.

    Raises:
        LocalSGDConfigError: an invalid setting (the message echoes it).
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, ``model`` not a module.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        sync_every: int | str,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        *,
        compression: Compressor | type[Compressor] | str | None = Compression.none,
        overlap_steps: int = 0,
        fragments: int = 1,
        sync_warmup_steps: int | None = None,
        process_set: ProcessSet | None = None,
        world: World | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, LocalSGD):
            raise TypeError(f"LocalSGD wraps a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"LocalSGD needs the model (a torch.nn.Module), got {type(model).__name__}.")
        w = get_world() if world is None else world
        named = list(model.named_parameters())
        self._grad_compression: Compressor | None = None  # set: synchronous steps (auto)
        self._sync_bytes = 0
        outer = OuterArgs(outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
                          overlap_steps=overlap_steps, fragments=fragments,
                          sync_warmup_steps=sync_warmup_steps)
        if sync_every is None:
            raise LocalSGDConfigError("sync_every=None: LocalSGD runs local steps. HINT: sync_every=32, "
                                      "or 'auto'; synchronous training is hvd.DistributedOptimizer.")
        # with "auto", a placeholder period: the outer settings are checked now
        config, auto = local_steps_config(sync_every, outer, compression, error=LocalSGDConfigError)
        assert config is not None
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        outside = [n for n, p in named if p.requires_grad and id(p) not in in_opt]
        if outside:
            raise LocalSGDConfigError(
                f"the optimizer does not update {outside[:5]} of the model. HINT: build the inner "
                "optimizer over model.parameters(), or freeze those parameters first."
            )
        if process_set is None:
            broadcast_parameters(named, root_rank=0, world=w)
        self._inner = optimizer
        self._world, self._process_set = w, process_set
        self._named, self._config = named, config
        self._params = [p for _, p in named if p.requires_grad]
        self._outer: OuterSync | None = None
        self._auto: AutoMode | None = None
        if auto:
            self._start_auto()
        else:
            self._outer = OuterSync([p for _, p in named], config, world=w, process_set=process_set)
        init_optimizer_bookkeeping(self)

    def _start_auto(self) -> None:
        """``sync_every="auto"``: synchronous steps with plain allreduce while
        :class:`~hvd_trainer.comm.reduce.auto.AutoMode` measures (on one host it has chosen
        already); :meth:`step` takes the choice."""
        trainable = [p for p in self._params if p.is_floating_point()]
        device = trainable[0].device if trainable else torch.device("cpu")
        grad_bytes = sum(p.numel() for p in trainable) * 4  # fp32 on the wire
        pset = resolve_set(self._process_set, self._world, "sync_every=auto")
        self._grad_compression = Compression.none
        self._auto = AutoMode(self._world, pset, device, grad_bytes, asked={"sync_every": True})
        if self._auto.choice is not None:
            self._take_auto(self._auto.choice)

    def _take_auto(self, choice: AutoChoice) -> None:
        """Local steps from here on (the outer loop anchored at these parameters, equal on every
        rank after synchronous steps), or synchronous steps in the chosen wire format."""
        if choice.sync_every is None:
            self._grad_compression = choice.compression
            return
        self._grad_compression = None
        config = replace(self._config, sync_every=choice.sync_every)
        self._outer = OuterSync([p for _, p in self._named], config, world=self._world,
                                process_set=self._process_set)

    # -- delegation (the inner optimizer's groups, state and defaults) ------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer."""
        return self._inner

    @property
    def outer(self) -> OuterSync | None:
        """The outer loop (anchors, outer SGD, counters); ``None`` when ``sync_every="auto"``
        chose synchronous steps."""
        return self._outer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner.defaults = value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_inner" or "_inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        if self._outer is None:
            return f"LocalSGD({self._inner!r}, sync_every='auto': synchronous)"
        c = self._outer.config
        return (f"LocalSGD({self._inner!r}, sync_every={c.sync_every}, outer_lr={c.outer_lr}, "
                f"outer_momentum={c.outer_momentum}, nesterov={c.nesterov}, "
                f"sync_warmup_steps={c.sync_warmup_steps})")

    # -- steps ----------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One inner step; then, during the synchronous warm-up, an average of the parameters,
        and after it, on every ``sync_every``-th call, the outer step (collectives)."""
        if self._outer is None:
            loss = self._synchronous_step(closure)
            if self._auto is not None and self._auto.measuring:
                choice = self._auto.step_end(self._world)
                if choice is not None:
                    self._take_auto(choice)
            return loss
        loss = self._inner.step() if closure is None else self._inner.step(closure)
        self._outer.after_inner_step()
        return loss

    def _synchronous_step(self, closure: Callable[[], Any] | None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for p in self._params if p.grad is not None]
        if grads:
            measuring = self._auto is not None and self._auto.measuring
            with self._auto.waiting() if measuring else contextlib.nullcontext():
                grouped_allreduce_(grads, op=Average, name="local_steps.auto.gradients",
                                   compression=self._grad_compression, process_set=self._process_set,
                                   world=self._world)
            n = resolve_set(self._process_set, self._world, "LocalSGD").size()
            wire = self._grad_compression.wire_dtype if self._grad_compression.applies_to(grads[0]) \
                else grads[0].dtype
            size = torch.empty((), dtype=wire).element_size()
            self._sync_bytes += 2 * (n - 1) * sum(g.numel() for g in grads) * size // max(1, n)
        self._inner.step()
        return loss

    @property
    def wire_bytes_sent(self) -> int:
        """Bytes this rank has sent for outer steps so far (:attr:`OuterSync.bytes_sent`: a ring
        allreduce sends ``2 (N-1)/N`` of the wire payload), or for the gradients when
        ``sync_every="auto"`` chose synchronous steps (ring allreduce, the same count)."""
        return self._sync_bytes if self._outer is None else self._outer.bytes_sent

    def sync(self) -> None:
        """Run the outer step now (every rank must call it), e.g. after the last inner step so
        that the ranks end with equal parameters (synchronous steps keep them equal already);
        an outer step still on the wire (``overlap_steps``) is finished first."""
        if self._outer is not None:
            self._outer.sync()

    def settle(self) -> None:
        """At the end of training: equal parameters on every rank with the fewest collectives
        (:meth:`OuterSync.settle`: finishes an outer step still on the wire, runs one for the
        inner steps since the last; nothing when neither). Every rank must call it."""
        if self._outer is not None:
            self._outer.settle()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)

    @property
    def sync_every(self) -> int:
        """Inner steps per outer step (1 when ``"auto"`` chose synchronous steps)."""
        return 1 if self._outer is None else self._outer.config.sync_every

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"inner": ..., "outer": ...}`` of this rank (see the class docstring)."""
        outer = None if self._outer is None else self._outer.state_dict()
        return {"inner": self._inner.state_dict(), "outer": outer}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load :meth:`state_dict`'s output (load the model's own ``state_dict`` too).

        Raises:
            LocalSGDConfigError: the dict lacks ``"inner"``/``"outer"`` (e.g. a plain
                optimizer's state_dict) or was saved for other parameter shapes.
        """
        if not (isinstance(state_dict, dict) and {"inner", "outer"} <= set(state_dict)):
            raise LocalSGDConfigError(
                f"LocalSGD.load_state_dict expects {{'inner': ..., 'outer': ...}}, got keys "
                f"{sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__}. "
                "HINT: load what LocalSGD.state_dict() saved; a plain optimizer's state_dict goes "
                "to opt.optimizer.load_state_dict()."
            )
        if self._auto is not None and self._auto.measuring and state_dict["outer"] is not None:
            # saved after "auto" chose local steps: take up that period instead of measuring
            self._auto.adopt(AutoChoice(Compression.none, int(state_dict["outer"]["sync_every"]),
                                        "restored from a state_dict"))
            self._take_auto(self._auto.choice)
        if (self._outer is None) != (state_dict["outer"] is None):
            raise LocalSGDConfigError(
                "LocalSGD.load_state_dict: the state was saved with "
                f"{'synchronous' if state_dict['outer'] is None else 'local'} steps, this optimizer "
                f"takes {'synchronous' if self._outer is None else 'local'} ones (sync_every='auto' "
                "chose differently on this link). HINT: pass the sync_every the saved run used."
            )
        self._inner.load_state_dict(state_dict["inner"])
        if self._outer is not None:
            self._outer.load_state_dict(state_dict["outer"])

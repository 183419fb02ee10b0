"""ZeRO stages 1 and 2 around a torch optimizer: step only the owned parameters, give the
others their update from their owners, and keep optimizer state for the owned ones only.

Used by the torch ``DistributedOptimizer(zero_stage=...)`` and by the Lightning strategy;
it knows no framework. One step (after the gradients were averaged: allreduced in stage 1,
reduce-scattered to their owners in stage 2):

1. Stage 1 sets ``.grad = None`` on the parameters this rank does not own (restored after the
   step, so the user still sees every averaged gradient); in stage 2 they are ``None`` already.
   torch's per-parameter optimizers skip a parameter whose ``.grad`` is ``None`` and create no
   state for it, so the inner ``step()`` updates (and keeps moments for) the owned ones only.
2. The inner optimizer steps; a parameter cut between ranks (a plan by elements) is stepped
   as the pieces this rank owns (:mod:`hvd_trainer.comm.zero.pieces`).
3. :func:`~hvd_trainer.comm.zero.collectives.exchange_parameters` copies every parameter (or
   piece) from its owner (an allgather per balanced bucket, broadcasts for the others).

Optimizer state bytes per rank: ``(state bytes per parameter byte) * owned_bytes(r)``, with
``owned_bytes(r) = total/N`` within one parameter, or within ``N - 1`` elements by elements
(:mod:`hvd_trainer.comm.zero.plan`).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from hvd_trainer.comm.base.errors import CommValueError
from hvd_trainer.comm.ops.ops import ReduceOp
from hvd_trainer.comm.ops.process_set import ProcessSet, resolve_set
from hvd_trainer.comm.ops.reduce import start_allreduce
from hvd_trainer.comm.reduce.fusion import FusionConfig, GradientReducer
from hvd_trainer.comm.world.world import World
from hvd_trainer.comm.zero.collectives import PendingExchange, exchange_parameters
from hvd_trainer.comm.zero.pieces import Pieces, join_states, per_element
from hvd_trainer.comm.zero.plan import ShardPlan
from hvd_trainer.comm.zero.reducer import ShardedGradientReducer, plan_parameters

__all__ = ["ZeroSharding", "UnshardableOptimizerError", "check_per_parameter", "state_bytes"]

PER_PARAMETER = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta",
                 "RMSprop", "Rprop", "ASGD", "Adafactor", "Muon")
"""``torch.optim`` classes whose step updates each parameter from its own gradient and state
(and skips a parameter whose ``.grad`` is ``None``): safe to shard by parameter."""

NOT_PER_PARAMETER = {
    "LBFGS": "its step is one line search over all parameters at once (closure-driven)",
    "SparseAdam": "it needs sparse gradients, which the sharded reduction makes dense",
}
"""``torch.optim`` classes refused, with the reason."""


class UnshardableOptimizerError(CommValueError):
    """The optimizer's step is not per parameter, so its state cannot be sharded by parameter."""


def check_per_parameter(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose step is not per parameter.

    A ``torch.optim`` class listed in :data:`PER_PARAMETER` passes; one of
    :data:`NOT_PER_PARAMETER` is refused; any other (a custom optimizer) passes unless its
    ``step`` requires a closure, and is then assumed to update each parameter from its own
    gradient and state and to skip parameters without a gradient (as torch's do).

    Raises:
        UnshardableOptimizerError: naming the optimizer and why.
    """
    name = type(optimizer).__name__
    module = type(optimizer).__module__
    reason = NOT_PER_PARAMETER.get(name) if module.startswith("torch.optim") else None
    if reason is None:
        params = inspect.signature(optimizer.step).parameters
        closure = params.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            reason = "its step() requires a closure (it evaluates the loss over all parameters)"
    if reason is not None:
        raise UnshardableOptimizerError(
            f"ZeRO sharding cannot wrap {module}.{name}: {reason}. ZeRO assigns each parameter "
            "to one rank, which steps it alone. HINT: use zero_stage=0 with this optimizer, or a "
            f"per-parameter one ({', '.join(PER_PARAMETER[:6])}, ...)."
        )


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Sum of ``numel * element_size`` over every tensor in ``optimizer.state`` (bytes)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


class ZeroSharding:
    """Which parameters this rank steps, and the step / state-dict logic of ZeRO 1 and 2.

    Args:
        named: ``(name, parameter)`` of every parameter the optimizer updates, the same order
            on every rank; those with ``requires_grad=False`` are not sharded (they keep no
            state and are not exchanged).
        optimizer: the torch optimizer whose parameters these are (checked with
            :func:`check_per_parameter`; state of parameters owned elsewhere is dropped).
        stage: 1 or 2. With an optimizer whose update is per element
            (:data:`~hvd_trainer.comm.zero.pieces.PER_ELEMENT`: SGD, Adam, AdamW, ...) the
            shards are planned by elements (:attr:`split`): every rank holds ``1/N`` of the
            state (and in stage 2 of the averaged gradients) within ``N - 1`` elements, whatever
            the model; a parameter may then be cut between ranks
            (:mod:`hvd_trainer.comm.zero.pieces`). Otherwise each parameter is owned whole
            (balanced within one parameter per bucket).
        world: the world.
        config: the reducer's bucket sizes (the plan follows its buckets).
        process_set: shard over these ranks (``None``: all). On a rank outside it nothing is
            sharded (it steps every parameter itself, as its reducer does nothing).
        overlap_exchange: leave the parameter exchange running after :meth:`step` and finish
            each bucket just before the first module that holds one of its parameters runs its
            forward (a global ``torch.nn`` forward pre-hook, removed once all are finished), so
            the transfer overlaps the next forward pass. The other finishing points:
            :meth:`finish_exchange` (public), the next :meth:`step`, :meth:`consolidate`. Until
            then a parameter owned by another rank holds its old value (or a partly received
            new one): code that reads parameters outside a module's own forward (a functional
            call on another module's weight, ``model.state_dict()`` right after ``step()``) must
            call :meth:`finish_exchange` first.
        plan: the stage-2 reducer's plan, to follow instead of planning here (the same
            parameters, bucket config and ranks; whether it is by elements decides
            :attr:`split`).

    Raises:
        UnshardableOptimizerError: see :func:`check_per_parameter`.
        CommValueError: ``stage`` not 1 or 2; a ``plan`` over other parameters or ranks.
        ZeroLayoutError: later, from :meth:`step` and the state-dict methods, when a parameter
            cut between ranks was made non-contiguous after this object was built.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        optimizer: torch.optim.Optimizer,
        *,
        stage: int,
        world: World,
        config: FusionConfig | None = None,
        process_set: ProcessSet | None = None,
        overlap_exchange: bool = False,
        plan: ShardPlan | None = None,
    ) -> None:
        if stage not in (1, 2):
            raise CommValueError(f"zero_stage={stage!r}: ZeroSharding implements stages 1 and 2.")
        check_per_parameter(optimizer)
        self.stage = stage
        self.active = process_set is None or process_set.included()
        self.pset = resolve_set(process_set, world, "ZeRO sharding") if self.active else None
        self.named = [(n, p) for n, p in named if p.requires_grad]
        size = self.pset.size() if self.pset is not None else 1
        if plan is None:
            split = size > 1 and per_element(optimizer)
            plan = plan_parameters(self.named, config, size, split=split)
        elif plan.size != size or len(plan.owner) != len(self.named):
            raise CommValueError(f"the shard plan covers {len(plan.owner)} parameters over "
                                 f"{plan.size} ranks, not these {len(self.named)} over {size}. "
                                 "HINT: pass the stage-2 reducer's plan over the same parameters.")
        self.plan: ShardPlan = plan
        self.split = plan.by_elements
        """The shards are planned by elements (parameters may be cut between ranks)."""
        self._optimizer = optimizer
        me = self.pset.rank() if self.pset is not None else 0
        self.rank = me
        self.owned_ids = {id(self.named[i][1]) for i in self.plan.owned(me)} if self.active else \
            {id(p) for _, p in self.named}
        self._sharded_ids = {id(p) for _, p in self.named}
        self.pieces = Pieces(((self.named[i][1], s, n, o) for shard in self.plan.buckets
                              for i, s, n, o in zip(shard.params, shard.starts, shard.numels,
                                                    shard.owners, strict=True)
                              if n != self.named[i][1].numel()), me)
        self._buckets = [
            (shard, [(self.named[i][1], s) for i, s in zip(shard.params, shard.starts, strict=True)],
             f"{self.named[shard.params[0]][0]}..{self.named[shard.params[-1]][0]}")
            for shard in self.plan.buckets if shard.params
        ]
        self._consolidated: dict[str, Any] | None = None
        self.overlap_exchange = overlap_exchange
        self._pending: PendingExchange | None = None
        self._hook: RemovableHandle | None = None
        self._forward_seen = False  # a module's forward ran while an exchange was pending
        self._warned = False
        self.pieces.split_loaded(optimizer)  # state made in the constructor (Adagrad's)
        self.drop_unowned_state(optimizer)

    # -- ownership ---------------------------------------------------------------------------
    def owns(self, p: torch.Tensor) -> bool:
        """Whether this rank steps ``p``, or a piece of it if it is cut between ranks
        (parameters outside the plan: always)."""
        if self.pieces.is_cut(p):
            return self.pieces.owned_numel(p) > 0
        return id(p) in self.owned_ids or id(p) not in self._sharded_ids

    def owned_numel(self, p: torch.Tensor) -> int:
        """Elements of ``p`` this rank steps (all, none, or its pieces' when ``p`` is cut)."""
        if self.pieces.is_cut(p):
            return self.pieces.owned_numel(p)
        return p.numel() if self.owns(p) else 0

    def owned_parameters(self) -> list[torch.Tensor]:
        """The parameters this rank owns whole."""
        return [p for _, p in self.named if id(p) in self.owned_ids]

    def drop_unowned_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Delete optimizer state of parameters owned by another rank (e.g. after loading a
        full state dict, or the eager state Adagrad makes in its constructor), of a cut
        parameter as a whole, and of anything no longer in ``param_groups`` (the pieces of an
        earlier plan) but this rank's pieces."""
        self.pieces.release(optimizer)
        in_groups = {id(p) for group in optimizer.param_groups for p in group["params"]}
        mine = self.pieces.owned_ids()
        for key in list(optimizer.state):
            if id(key) in mine:
                continue
            if id(key) not in in_groups or self.pieces.is_cut(key) or not self.owns(key):
                del optimizer.state[key]

    # -- step --------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        """Step ``optimizer`` on the owned parameters, then exchange the updated ones.

        ``closure`` (optional) is evaluated first, under ``enable_grad`` (it runs backward and
        returns the loss), then the step runs without it, so a parameter's gradient from the
        closure cannot make a non-owner step it. Returns the closure's loss (or the inner
        step's return value).
        """
        self._warn_if_not_reached()
        self.finish_exchange()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stash = []
        if self.active:
            for p in self._unowned():
                if p.grad is not None:
                    stash.append((p, p.grad))
                    p.grad = None
        try:
            with self.pieces.stepping(optimizer):
                out = optimizer.step()
        finally:
            for p, g in stash:
                p.grad = g
        if self.active and self.pset is not None and self.pset.size() > 1:
            buckets = self._exchanged_buckets()
            if self.overlap_exchange:
                # Forward order (buckets are in backward order): the first layers' arrive first.
                self._pending = exchange_parameters(buckets[::-1], pset=self.pset, defer=True)
                self._forward_seen = False
                self._hook = register_module_forward_pre_hook(self._before_forward)
            else:
                exchange_parameters(buckets, pset=self.pset)
        return loss if closure is not None else out

    def _exchanged_buckets(self) -> list[tuple[Any, list[torch.Tensor], str]]:
        """The buckets for :func:`exchange_parameters`: each entry's parameter, or its piece."""
        return [(shard, [self.pieces.view(p, s) if self.pieces.is_cut(p) else p for p, s in entries],
                 label) for shard, entries, label in self._buckets]

    def finish_exchange(self) -> None:
        """Finish a parameter exchange left running by ``overlap_exchange`` (no-op otherwise):
        afterwards every parameter holds its owner's update. Every rank must call it at the same
        point relative to its other collectives (the transfers are checked like them)."""
        pending = self._pending
        self.abandon_exchange()
        if pending is not None:
            pending.finish()

    def _warn_if_not_reached(self) -> None:
        """Once per object: a forward ran since the last step, yet some exchanged parameters of
        other owners were never reached through their own module's forward: they were unused,
        or read outside their module (a functional call), where the old value was used."""
        pending = self._pending
        if self._warned or pending is None or pending.finished or not self._forward_seen:
            return
        names = {id(t): n for n, p in self.named for t in self.pieces.of(p)}
        mine = self.owned_ids | self.pieces.owned_ids()
        missed = [names[id(p)] for p in pending.unfinished() if id(p) in names and id(p) not in mine]
        if missed:
            self._warned = True
            warnings.warn(
                f"zero overlap_exchange: parameters {missed[:8]}{' ...' if len(missed) > 8 else ''} "
                "were not reached through their own module's forward since the last step, so their "
                "exchange was finished only now. If the forward read them another way (a functional "
                "call on another module's weight), it used the previous step's values. HINT: call "
                "finish_parameter_exchange() before such a forward, or turn the overlap off; if they "
                "are simply unused, ignore this.", UserWarning, stacklevel=3)

    def abandon_exchange(self) -> None:
        """Forget a pending exchange without waiting for it (after a failure: a peer may be
        gone); the forward hook is removed. Parameters of other owners keep whatever arrived."""
        self._pending = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        pending = self._pending
        if pending is None:
            return
        self._forward_seen = True
        pending.finish_for(t for p in module._parameters.values() if p is not None
                           for t in self.pieces.of(p))
        if pending.finished:
            self.finish_exchange()

    def _unowned(self) -> list[torch.Tensor]:
        """Parameters owned whole by another rank."""
        return [p for _, p in self.named if id(p) not in self.owned_ids and not self.pieces.is_cut(p)]

    # -- gradients ---------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_``
        over every parameter would (call after the gradients were averaged).

        Stage 1 holds every averaged gradient: the norm is computed locally (no communication).
        Stage 2 holds only owned ones: each rank sums ``|g|^p`` over its gradients (max for
        ``inf``) and one 8-byte allreduce combines them. Returns the total norm (float32 for
        fp32 gradients, as torch's).
        """
        grads = [p.grad for _, p in self.named if p.grad is not None] + self.pieces.owned_grads()
        norm_type = float(norm_type)
        if self.stage == 2 and self.active and self.pset is not None and self.pset.size() > 1:
            total = self._sharded_norm([g for g in grads if g is not None], norm_type)
        else:
            total = self._local_norm(grads, norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}). "
                "HINT: pass error_if_nonfinite=False to clip anyway."
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return total

    @staticmethod
    def _local_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        if not grads:
            return torch.tensor(0.0)
        norms = [torch.linalg.vector_norm(g.detach(), norm_type) for g in grads]
        return torch.linalg.vector_norm(torch.stack(norms), norm_type)

    def _sharded_norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        assert self.pset is not None
        dtype = grads[0].dtype if grads else torch.float32
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type) for g in grads])
            norms = norms.double().cpu()
            local = norms.max() if math.isinf(norm_type) else (norms ** norm_type).sum()
        else:
            local = torch.tensor(0.0, dtype=torch.float64)
        op = ReduceOp.MAX if math.isinf(norm_type) else ReduceOp.SUM
        both = local.reshape(1).clone()
        start_allreduce(both, op=op, pset=self.pset, name="zero.grad_norm").finish()
        total = both[0] if math.isinf(norm_type) else both[0] ** (1.0 / norm_type)
        return total.to(dtype)

    def after_reduction(self, reducer: GradientReducer) -> None:
        """Stage 2, right after the reducer's ``wait()``: the averaged gradients of the pieces
        this rank owns (``reducer.piece_grads`` of the :class:`ShardedGradientReducer`) stand in
        ``param_groups`` for their cut parameters until the step (so ``GradScaler.unscale_``
        reaches them), then :meth:`agree_nonfinite`. No-op in stage 1."""
        if self.stage != 2 or not self.active:
            return
        grads = reducer.piece_grads if isinstance(reducer, ShardedGradientReducer) else {}
        self.pieces.hold(self._optimizer, grads)
        self.agree_nonfinite()

    def restore_param_groups(self) -> None:
        """Cut parameters back in the optimizer's ``param_groups`` and held piece gradients
        dropped: before its ``zero_grad`` (a step skipped by ``GradScaler`` leaves the pieces
        there), and before this object is replaced (a new world's plan) or discarded."""
        self.pieces.drop(self._optimizer)

    def agree_nonfinite(self) -> None:
        """Stage 2: make every rank see a non-finite gradient when any rank's shard has one.

        ``GradScaler`` decides to skip a step from the gradients it unscales, and a stage-2 rank
        holds only its shard: without this, ranks could disagree and the parameter exchange of
        the step would hang. Cost: one fused finiteness pass over the owned gradients and one
        4-byte allreduce. A rank whose shard is finite while another's is not gets a NaN
        written into one owned gradient (the step is skipped anyway).
        """
        if self.stage != 2 or not self.active or self.pset is None or self.pset.size() < 2:
            return
        grads = [g for g in (p.grad for p in self.owned_parameters()) if g is not None]
        grads += self.pieces.owned_grads()
        found = torch.zeros(1, dtype=torch.float32)
        if grads:
            inf = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
            one = torch.ones(1, dtype=torch.float32, device=grads[0].device)
            per_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for g in grads:
                per_dtype.setdefault(g.dtype, []).append(g)
            for group in per_dtype.values():
                if group[0].is_floating_point():
                    torch._amp_foreach_non_finite_check_and_unscale_(group, inf, one)
            found = inf.cpu()
        local = bool(found.item())
        start_allreduce(found, op=ReduceOp.MAX, pset=self.pset, name="zero.nonfinite").finish()
        if found.item() and not local and grads:
            grads[0].view(-1)[:1] = float("nan")

    # -- state dict --------------------------------------------------------------------------
    def consolidate(self, optimizer: torch.optim.Optimizer, to: int | None = 0) -> None:
        """Gather every rank's optimizer state on rank ``to`` of the process set (a collective:
        every member calls it). Rank ``to`` then returns the full state from
        :meth:`state_dict`; the others keep nothing extra. ``to=None``: every rank gets it.

        The states travel as pickled CPU tensors (``torch.distributed.gather_object``, or
        ``all_gather_object`` for ``to=None``, on the gloo group).
        """
        self.finish_exchange()
        self._consolidated = None
        if not self.active or self.pset is None or self.pset.size() == 1:
            self._consolidated = optimizer.state_dict()
            return
        if to is not None and not 0 <= to < self.pset.size():
            raise CommValueError(f"to={to} is not a rank of the process set (size {self.pset.size()}).")

        def cpu(state: dict) -> dict:
            return {n: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for n, v in state.items()}

        with self.pieces.set_aside(optimizer) as aside:
            local = optimizer.state_dict()
            cpu_state = ({k: cpu(s) for k, s in local["state"].items()},
                         {k: (n, cpu(s)) for k, (n, s) in aside.items()})
        me = self.pset.rank()
        gathered: list[Any] | None = [None] * self.pset.size() if to in (me, None) else None
        if to is None:
            dist.all_gather_object(gathered, cpu_state, group=self.pset.cpu_group)
        else:
            dist.gather_object(cpu_state, gathered, dst=self.pset.ranks[to], group=self.pset.cpu_group)
        if to in (me, None):
            assert gathered is not None
            merged: dict[Any, Any] = {}
            pieces: dict[tuple[int, int], tuple[int, dict]] = {}
            for whole, part in gathered:
                merged.update(whole)
                pieces.update(part)
            order = [p for group in optimizer.param_groups for p in group["params"]]
            joined = join_states(pieces, {k: p.shape for k, p in enumerate(order)})
            merged.update(joined)
            partial = sorted({index for index, _ in pieces} - set(joined))
            if partial:
                warnings.warn(
                    f"ZeRO: the optimizer state of parameters {partial[:8]} (state_dict indices) "
                    "exists on some of the ranks that own pieces of them but not on all, so it is "
                    "left out of the gathered state. This happens after a full state was loaded on "
                    "one rank only (Horovod's load-on-rank-0-then-broadcast). HINT: with ZeRO, "
                    "load a checkpoint with load_state_dict on every rank.", UserWarning, stacklevel=2)
            self._consolidated = {"state": dict(sorted(merged.items())),
                                  "param_groups": local["param_groups"]}

    def state_dict(self) -> dict[str, Any]:
        """The full state gathered by :meth:`consolidate` (loadable by a plain torch optimizer).

        Raises:
            CommValueError: :meth:`consolidate` did not put it on this rank.
        """
        if self._consolidated is None:
            raise CommValueError(
                "the optimizer state is sharded and was not consolidated on this rank. HINT: call "
                "optimizer.consolidate_state_dict(to=r) on every rank first, then state_dict() "
                "on rank r."
            )
        return self._consolidated

    def pop_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict`, after which this object no longer holds the gathered state."""
        state = self.state_dict()
        self._consolidated = None
        return state

    def load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Load a full (unsharded) state and keep the owned parameters' part; it may come from
        any number of ranks (the plan is this job's)."""
        optimizer.load_state_dict(state_dict)
        self.pieces.split_loaded(optimizer)
        self.drop_unowned_state(optimizer)
        self._consolidated = None

"""Local steps with an outer optimizer: DiLoCo / LocalSGD (framework neutral).

Algorithm (Douillard et al. 2023, "DiLoCo", arXiv:2311.08105, Algorithm 1), for the parameters
``theta`` of a model replicated on ``N`` ranks that start equal:

1. at the last synchronisation every rank stored the *anchor* ``theta_g`` (the global
   parameters, fp32 for floating parameters narrower than fp32);
2. each rank takes ``sync_every`` (``H``) steps of its own *inner* optimizer on its own data,
   with no communication: ``theta_r`` drifts from ``theta_g``;
3. the *outer gradient* is the average over ranks of ``delta_r = theta_g - theta_r`` (one
   allreduce of the parameters' size, in fp32 unless ``compression`` narrows it);
4. the outer optimizer, SGD with (Nesterov) momentum by default (``torch.optim.SGD`` semantics:
   ``b = mu * b + delta``; ``u = delta + mu * b`` with Nesterov, else ``b``;
   ``theta_g -= outer_lr * u``), updates the anchor;
5. every rank loads the anchor into its parameters (bit-identical on every rank: same anchor,
   same averaged delta, same arithmetic).

Synchronous warm-up (``sync_warmup_steps`` = ``W``, by default 128; after post-local SGD,
Lin et al. 2020, "Don't Use Large Mini-Batches, Use Local SGD", arXiv:1808.07217, which starts
local steps only after a synchronous phase): the first ``W`` inner steps are each followed by a
plain average of the parameters (the outer gradient of that one step, averaged and subtracted
from the anchor: outer lr 1, no momentum, the outer SGD's state untouched), so the ranks leave
the fast-changing start of training together; local steps with the outer SGD begin after it.
From scratch, DiLoCo's outer momentum applied to the large deltas of the first periods left the
model behind the synchronous run for the rest of training (README, "Slow links: compression
and local steps", its figures).
``W = 0`` starts local steps at once (e.g. when resuming a trained model).

``sync_every=1``, ``outer_lr=1.0``, ``outer_momentum=0.0`` is synchronous data parallel for
inner optimizers that are linear in the gradient (SGD, with momentum and weight decay): the
average of ``theta_g - lr * g_r`` is ``theta_g - lr * mean(g)``. (Adam's per-rank moments of
local gradients are not the moments of the averaged gradient.)

Hidden outer step (``overlap_steps`` = ``tau`` > 0; after Streaming DiLoCo's overlapping of
communication with computation, Douillard et al. 2025, arXiv:2501.18512, section 2.2): at the
``H``-th inner step the outer gradient's allreduce is *launched*, and each rank keeps a copy
``theta_s`` of its parameters then and goes on with inner steps while it is on the wire. ``tau``
inner steps later it is finished, the outer SGD updates the anchor as above, and each rank loads
the new anchor *plus the local progress since the launch*: ``theta_r <- theta_g + (theta_r -
theta_s)``. Nothing is dropped: that local progress is part of the next outer gradient (the next
launch is ``H`` inner steps after this one). The ranks' parameters are equal only after
:meth:`OuterSync.sync` (e.g. at the end of training), as between any two outer steps. Cost: one
more copy of the parameters (``theta_s``, fp32 for narrower floating parameters) while the
reduction is in flight. ``tau = 0`` is the blocking outer step above.

Fragments (``fragments`` = ``F`` > 1; Streaming DiLoCo, Douillard et al. 2025,
arXiv:2501.18512, section 2.1): the parameters, in their order, are cut into ``F`` consecutive
parts of about equal size, and each part has its own outer step, with the anchors, momentum and
(with ``tau``) the delay above restricted to it. An outer step of one part is launched every
``H / F`` inner steps, part ``0``, ``1``, ..., ``F - 1`` in turn, so each part is synchronised
every ``H`` inner steps as before, while one reduction moves ``1/F`` of the bytes: the wire is
busy evenly instead of in bursts, and a reduction is hidden behind ``tau < H / F`` steps. A full
:meth:`OuterSync.sync` steps every part at once.

Traffic: one allreduce of the parameters every ``H`` inner steps instead of one of the gradients
every step (``H`` times fewer bytes at fp32). ``compression=Compression.int8`` quantises the outer
gradient per block of 256 values (one fp32 scale ``absmax / 127`` each,
:mod:`hvd_trainer.comm.reduce.compressed.int8`) and averages it the way int8 gradients are
(:func:`~hvd_trainer.comm.reduce.compressed.reduce_with_feedback`: one allgather at 2 ranks,
reduce-scatter and allgather of requantised chunks from 3); every rank gets the same result. It
carries no error feedback: the outer gradient is already an average over ``H`` steps, and
Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512, section 2.3) quantises it to 4 bits
without any. Bytes a rank sends for ``n`` values: about ``2 (N-1)/N (n + 4n/256)`` against
``2 (N-1)/N 4n`` at fp32 (3.9x fewer at every N). Memory: the anchor and the momentum buffer, two
fp32 copies of the parameters. Buffers (e.g. BatchNorm's running statistics) stay local.
The inner optimizer's state stays local to each rank, as in DiLoCo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from hvd_trainer.comm.base.errors import CommValueError
from hvd_trainer.comm.ops.compression import Compression, Compressor, Int8Compressor
from hvd_trainer.comm.ops.ops import ReduceOp
from hvd_trainer.comm.ops.process_set import ProcessSet, resolve_set
from hvd_trainer.comm.ops.reduce import start_allreduce
from hvd_trainer.comm.reduce.compressed import FeedbackState, reduce_with_feedback
from hvd_trainer.comm.world.world import World

__all__ = ["DEFAULT_SYNC_WARMUP_STEPS", "LocalSGDConfig", "LocalSGDConfigError", "OuterArgs", "OuterSync",
           "refuse_fragments_with_auto"]

DEFAULT_SYNC_WARMUP_STEPS = 128
"""Inner steps averaged one by one before local steps begin, unless set (``sync_warmup_steps``)."""


class LocalSGDConfigError(CommValueError):
    """An invalid local-steps setting; the message echoes it and gives the fix."""


def refuse_fragments_with_auto(fragments: object, *, name: str = "fragments") -> None:
    """Refuse ``fragments`` other than 1 with ``sync_every="auto"`` (``name``: the front end's
    argument): the parts must divide a period not chosen yet.

    Raises:
        LocalSGDConfigError: naming the argument, with a HINT.
    """
    if fragments != 1:
        raise LocalSGDConfigError(
            f"{name}={fragments!r} with sync_every='auto': the parts must divide a period auto has "
            f"not chosen yet. HINT: give sync_every (e.g. sync_every=32, {name}=4), or leave "
            f"{name}=1 with 'auto'."
        )


@dataclass(frozen=True, kw_only=True)
class OuterArgs:
    """The outer optimizer of local steps as a front end's user gave it, with the library's
    defaults (DiLoCo's: outer lr 0.7, Nesterov momentum 0.9; no overlap, one part, the default
    warm-up). Unchecked: :class:`LocalSGDConfig` checks it with a period."""

    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    overlap_steps: int = 0
    fragments: int = 1
    sync_warmup_steps: int | None = None

    def changed(self) -> dict[str, Any]:
        """The arguments away from their defaults, by name, in declaration order."""
        default = OuterArgs()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


_DEFAULT = OuterArgs()


@dataclass(kw_only=True, slots=True)
class LocalSGDConfig:
    """Settings of the outer loop (DiLoCo's defaults: outer lr 0.7, Nesterov momentum 0.9)."""

    sync_every: int
    """Inner optimizer steps between two outer steps (``H``); 1 averages after every step."""
    outer_lr: float = _DEFAULT.outer_lr
    """Learning rate of the outer SGD applied to the averaged parameter delta."""
    outer_momentum: float = _DEFAULT.outer_momentum
    """Momentum of the outer SGD (0: none)."""
    nesterov: bool = _DEFAULT.nesterov
    """Nesterov momentum (ignored when ``outer_momentum`` is 0)."""
    compression: Compressor = Compression.none
    """Wire format of the outer gradient: ``Compression.none``/``fp16``/``bf16`` (the allreduce's
    dtype) or ``Compression.int8`` (block-quantised allgather, no error feedback)."""
    overlap_steps: int = _DEFAULT.overlap_steps
    """Inner steps the outer gradient's reduction may take on the wire while training goes on
    (``tau`` of the module docstring; ``0 <= tau < sync_every / fragments``); 0 blocks at every
    outer step."""
    fragments: int = _DEFAULT.fragments
    """Parts of the parameters with outer steps of their own, one launched every
    ``sync_every / fragments`` inner steps (``F`` of the module docstring; it must divide
    ``sync_every``); 1: all parameters at once."""
    sync_warmup_steps: int | None = _DEFAULT.sync_warmup_steps
    """Inner steps at the start each followed by a plain average of the parameters, before
    local steps begin (``W`` of the module docstring; ``None``: :data:`DEFAULT_SYNC_WARMUP_STEPS`;
    0: none)."""

    @classmethod
    def from_outer(cls, sync_every: int, outer: OuterArgs, compression: Any = None) -> LocalSGDConfig:
        """The config of period ``sync_every`` for ``outer``, the outer gradient in ``compression``.

        Raises:
            LocalSGDConfigError: as the constructor.
        """
        return cls(sync_every=sync_every, outer_lr=outer.outer_lr, outer_momentum=outer.outer_momentum,
                   nesterov=bool(outer.nesterov), compression=compression,
                   overlap_steps=outer.overlap_steps, fragments=outer.fragments,
                   sync_warmup_steps=outer.sync_warmup_steps)

    def __post_init__(self) -> None:
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise LocalSGDConfigError(
                f"sync_every={self.sync_every!r} must be an int >= 1 (inner steps between outer "
                "steps). HINT: sync_every=32; 1 averages after every step."
            )
        if not self.outer_lr > 0:
            raise LocalSGDConfigError(f"outer_lr={self.outer_lr!r} must be > 0. HINT: outer_lr=0.7 (DiLoCo).")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise LocalSGDConfigError(
                f"outer_momentum={self.outer_momentum!r} must be in [0, 1). HINT: outer_momentum=0.9."
            )
        self.compression = Compression.resolve(self.compression, error=LocalSGDConfigError,
                                               allow_error_feedback=True)
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int) or self.fragments < 1 \
                or self.sync_every % self.fragments:
            raise LocalSGDConfigError(
                f"fragments={self.fragments!r} must be an int >= 1 that divides sync_every={self.sync_every} "
                "(one part's outer step every sync_every / fragments steps). HINT: fragments=4 with "
                "sync_every=32; 1 steps all parameters at once."
            )
        period = self.sync_every // self.fragments
        if isinstance(self.overlap_steps, bool) or not isinstance(self.overlap_steps, int) \
                or not 0 <= self.overlap_steps < period:
            within = f"sync_every={self.sync_every}" if self.fragments == 1 else \
                f"sync_every / fragments={period}"
            raise LocalSGDConfigError(
                f"overlap_steps={self.overlap_steps!r} must be an int in [0, {within}) "
                "(inner steps the outer reduction runs behind, finished before the next one is "
                "launched). HINT: overlap_steps=sync_every // 4; 0 blocks at every outer step."
            )
        if self.sync_warmup_steps is None:
            self.sync_warmup_steps = DEFAULT_SYNC_WARMUP_STEPS
        if isinstance(self.sync_warmup_steps, bool) or not isinstance(self.sync_warmup_steps, int) \
                or self.sync_warmup_steps < 0:
            raise LocalSGDConfigError(
                f"sync_warmup_steps={self.sync_warmup_steps!r} must be an int >= 0 (steps averaged "
                "one by one before local steps begin). HINT: leave it unset (128); 0 "
                "starts local steps at once, e.g. when fine-tuning a trained model."
            )
        if self.overlap_steps and isinstance(self.compression, Int8Compressor):
            raise LocalSGDConfigError(
                f"overlap_steps={self.overlap_steps} with compression='int8': the int8 outer gradient "
                "is reduced in several dependent rounds, which are not overlapped. HINT: "
                "compression='bf16' (2x fewer bytes) with overlap_steps, or overlap_steps=0 with int8."
            )
        if self.compression.error_feedback and not isinstance(self.compression, Int8Compressor):
            raise LocalSGDConfigError(
                f"compression={self.compression.name!r} is not built for the outer gradient of local "
                "steps. HINT: compression='int8' (about 4x fewer bytes) or 'bf16' (2x)."
            )


class OuterSync:
    """The outer loop of DiLoCo over ``params``: counts inner steps and syncs every ``H``.

    Example:
        >>> outer = OuterSync(model.parameters(), LocalSGDConfig(sync_every=8), world=world)
        >>> for batch in loader:
        ...     loss(model, batch).backward(); inner.step(); inner.zero_grad()
        ...     outer.after_inner_step()          # every 8th call: the outer step

    Construction is not a collective: the parameters must already be equal on every rank
    (broadcast them first); the anchor is a copy of them.

    Args:
        params: the parameters to synchronise (floating point; the same, in the same order, on
            every rank). Frozen ones may be included (their delta is zero while frozen), so that
            parameters unfrozen later are synchronised too.
        config: the outer settings.
        world: the world to reduce over.
        process_set: reduce over these ranks only (``None``: all).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        config: LocalSGDConfig,
        *,
        world: World | None = None,
        process_set: ProcessSet | None = None,
    ) -> None:
        self.config = config
        self.params = [p for p in params if p.is_floating_point()]
        if not self.params:
            raise LocalSGDConfigError("local steps got no floating-point parameter to synchronise.")
        self._pset = resolve_set(process_set, world, "local steps")
        with torch.no_grad():
            self.anchors = [_anchor_copy(p) for p in self.params]
        momentum = config.outer_momentum
        self.outer = torch.optim.SGD(
            self.anchors, lr=config.outer_lr, momentum=momentum, nesterov=config.nesterov and momentum > 0
        )
        if config.fragments > len(self.params):
            raise LocalSGDConfigError(
                f"fragments={config.fragments} for {len(self.params)} floating-point parameters: "
                "each part needs one. HINT: fragments=1, or at most the number of parameters."
            )
        self.parts = _split_parts([p.numel() for p in self.params], config.fragments)
        """Indices into :attr:`params` of each part (``fragments`` consecutive runs)."""
        self.next_part = 0
        """The part whose outer step is launched next."""
        self.inner_steps = 0
        """Inner steps since the last outer step (of any part) was launched."""
        self.since_sync = 0
        """Inner steps since the last outer step of every part at once (:meth:`sync`): with
        ``fragments``, whether some part holds local progress :meth:`settle` must reduce."""
        self.warmup_left = config.sync_warmup_steps
        """Inner steps still to be averaged one by one (the synchronous warm-up)."""
        self.outer_steps = 0
        """Outer steps taken (with ``fragments``, each part's step counts one)."""
        self.bytes_sent = 0
        """Bytes this rank put on the wire for outer steps (ring allreduce: ``2 (N-1)/N`` of
        the payload)."""
        self._pending: _InFlight | None = None

    @property
    def in_flight(self) -> bool:
        """Whether an outer gradient's reduction is on the wire (``overlap_steps > 0``)."""
        return self._pending is not None

    def due(self) -> bool:
        """Whether the next :meth:`after_inner_step` communicates and changes the parameters (a
        warm-up average, an outer step launched, or one finished): a front end whose parameters
        live elsewhere (Keras) copies them in before that call and out after it."""
        steps = self.inner_steps + 1
        return (self.warmup_left > 0 or steps >= self._period
                or (self._pending is not None and steps >= self.config.overlap_steps))

    @property
    def _period(self) -> int:
        """Inner steps between two launches (of consecutive parts)."""
        return self.config.sync_every // self.config.fragments

    def after_inner_step(self) -> bool:
        """Count one inner step; during the synchronous warm-up, average the parameters (a
        collective); then on every ``sync_every``-th step run the outer step (a collective; with
        ``fragments``, one part's every ``sync_every / fragments`` steps): at once, or with
        ``overlap_steps`` launch it and finish it that many inner steps later.

        Returns:
            Whether the parameters were averaged, or an outer step was launched or ran.
        """
        if self.warmup_left > 0:
            self.warmup_left -= 1
            self._launch(overlap=False)
            self._finish(plain=True)
            return True
        self.inner_steps += 1
        self.since_sync += 1
        if self._pending is not None and self.inner_steps >= self.config.overlap_steps:
            self._finish()
        if self.inner_steps < self._period:
            return False
        part = None if self.config.fragments == 1 else self.parts[self.next_part]
        self.next_part = (self.next_part + 1) % self.config.fragments
        self._launch(overlap=bool(self.config.overlap_steps), part=part)
        if not self.config.overlap_steps:
            self._finish()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step now (every rank must call it): finish one still on the wire, then
        average ``anchor - param`` over the ranks, step the outer SGD on the anchors, load them
        into the parameters (equal on every rank afterwards)."""
        self.finish_in_flight()
        self._launch(overlap=False)
        self._finish()
        self.since_sync = 0

    def settle(self) -> None:
        """End of training: make the ranks' parameters equal with the fewest collectives (every
        rank must call it). An outer step launched at the last inner step is finished (the
        parameters become the anchors exactly); inner steps since the last launch get an outer
        step (:meth:`sync`); nothing to do when neither. With ``fragments``, the other parts'
        local progress since their own outer steps gets one too (:meth:`sync`)."""
        if not self.unsettled:
            return
        if self.config.fragments == 1 and self._pending is not None and self.inner_steps == 0:
            self._finish()
        else:
            self.sync()

    @property
    def unsettled(self) -> bool:
        """Whether :meth:`settle` would communicate: a reduction is in flight, or some
        parameters hold local progress no outer step has reduced yet."""
        progress = self.since_sync if self.config.fragments > 1 else self.inner_steps
        return self._pending is not None or progress > 0

    def finish_in_flight(self) -> None:
        """Finish an outer step still on the wire (a collective when one is; no-op otherwise):
        afterwards the anchors are current (e.g. before :meth:`state_dict`)."""
        if self._pending is not None:
            self._finish()

    @torch.no_grad()
    def _launch(self, *, overlap: bool, part: Sequence[int] | None = None) -> None:
        """Start averaging ``anchor - param`` over the ranks (int8: done here, blocking) for the
        parameters ``part`` (indices; ``None``: all); ``overlap``: inner steps follow before
        :meth:`_finish` (keep the parameters now)."""
        indices = list(range(len(self.params))) if part is None else list(part)
        deltas = {i: self.anchors[i] - self.params[i].to(self.anchors[i].dtype) for i in indices}
        snapshots = {i: self.params[i].detach().to(self.anchors[i].dtype, copy=True)
                     for i in indices} if overlap else None
        groups = []
        for group in _by_device_dtype(indices, deltas):
            flat = torch.cat([deltas[i].reshape(-1) for i in group])
            if isinstance(self.config.compression, Int8Compressor) and flat.is_floating_point():
                groups.append((group, self._int8_average(flat), None))
                continue
            handle = start_allreduce(flat, op=ReduceOp.AVERAGE, pset=self._pset,
                                     name="local_steps.outer_gradient",
                                     compression=self.config.compression, kind="outer")
            self.bytes_sent += _ring_bytes(flat, self.config.compression, self._pset.size())
            groups.append((group, flat, handle))
        self._pending = _InFlight(indices, groups, snapshots)
        self.inner_steps = 0

    @torch.no_grad()
    def _finish(self, *, plain: bool = False) -> None:
        """Finish the launched reduction, step the outer SGD (``plain``: subtract the averaged
        outer gradient from the anchors instead, the warm-up's average), load the anchors (plus
        the local progress since the launch, when it overlapped inner steps)."""
        pending, self._pending = self._pending, None
        assert pending is not None
        for group, flat, handle in pending.groups:
            if handle is not None:
                handle.finish()
            for i, piece in zip(group, flat.split([self.anchors[i].numel() for i in group]), strict=True):
                if plain:
                    self.anchors[i].sub_(piece.view_as(self.anchors[i]))
                else:
                    self.anchors[i].grad = piece.view_as(self.anchors[i])
        if not plain:
            self.outer.step()  # torch's SGD skips the anchors without a gradient (other parts)
        snapshots = pending.snapshots
        for k in pending.indices:
            a, p = self.anchors[k], self.params[k]
            a.grad = None
            if snapshots is None or self.inner_steps == 0:  # no inner step since the launch
                p.copy_(a)
            else:  # theta_g + (theta_r - theta_s)
                p.add_((a - snapshots[k]).to(p.dtype))
        if not plain:
            self.outer_steps += 1

    def _int8_average(self, flat: torch.Tensor) -> torch.Tensor:
        """The rank average of ``flat`` through int8 blocks (module docstring); ``flat``'s dtype."""
        once = FeedbackState(self.config.compression.name)  # no error feedback: dropped after
        (avg,), _ = reduce_with_feedback([("outer_gradient", flat)], compressor=self.config.compression,
                                         state=once, op=ReduceOp.AVERAGE, process_set=self._pset,
                                         name="local_steps.outer_gradient")
        self.bytes_sent += once.bytes_sent
        return avg

    def state_dict(self) -> dict[str, Any]:
        """The anchors, the outer SGD's state and the counters (copies; rank-independent except
        ``inner_steps``, which is the same on every rank that stepped in step). An outer step
        still on the wire is finished first (a collective then: call it on every rank)."""
        self.finish_in_flight()
        return {
            "anchors": [a.detach().clone() for a in self.anchors],
            "outer_optimizer": self.outer.state_dict(),
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "sync_every": self.config.sync_every,
            "warmup_left": self.warmup_left,
            "next_part": self.next_part,
            "since_sync": self.since_sync,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (parameters are not touched).

        Raises:
            LocalSGDConfigError: the anchors' count or shapes differ from the parameters'.
        """
        anchors = state["anchors"]
        shapes = [tuple(a.shape) for a in self.anchors]
        if [tuple(a.shape) for a in anchors] != shapes:
            raise LocalSGDConfigError(
                f"the local-steps state holds {len(anchors)} anchors of other shapes than the "
                f"{len(shapes)} parameters. HINT: load a state saved from the same model."
            )
        self._pending = None  # a reduction of the state being replaced is not applied
        for mine, saved in zip(self.anchors, anchors, strict=True):
            mine.copy_(saved)
        self.outer.load_state_dict(state["outer_optimizer"])
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state["outer_steps"])
        # a state saved before the warm-up existed was saved past its start: no warm-up again
        self.warmup_left = int(state.get("warmup_left", 0))
        self.next_part = int(state.get("next_part", 0)) % self.config.fragments
        self.since_sync = int(state.get("since_sync", self.inner_steps))


@dataclass(slots=True)
class _InFlight:
    """A launched outer step: the indices of the parameters it covers; per (device, dtype) group
    of them, the flat outer gradient being averaged in place and its handle (``None``: averaged
    already, int8); and those parameters at the launch, by index (``None`` for a blocking step)."""

    indices: list[int]
    groups: list[tuple[list[int], torch.Tensor, Any]]
    snapshots: dict[int, torch.Tensor] | None


def _anchor_copy(p: torch.Tensor) -> torch.Tensor:
    """fp32 copy of a floating parameter narrower than fp32, else a copy in its own dtype."""
    t = p.detach()
    wide = t.is_floating_point() and t.element_size() < 4
    return (t.float() if wide else t.clone()).contiguous()


def _by_device_dtype(indices: Sequence[int], tensors: dict[int, torch.Tensor]) -> list[list[int]]:
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i in indices:
        groups.setdefault((tensors[i].device, tensors[i].dtype), []).append(i)
    return list(groups.values())


def _split_parts(numels: Sequence[int], parts: int) -> list[list[int]]:
    """Cut ``range(len(numels))`` into ``parts`` non-empty consecutive runs of about equal total
    ``numel``: run ``k`` ends at the first index where the running total reaches
    ``(k + 1) / parts`` of the whole (leaving at least one index for each later run)."""
    total, out, start, acc = sum(numels), [], 0, 0
    for k in range(parts - 1):
        end = start
        acc += numels[end]
        while end + 1 < len(numels) - (parts - 1 - k) and acc * parts < (k + 1) * total:
            end += 1
            acc += numels[end]
        out.append(list(range(start, end + 1)))
        start = end + 1
    out.append(list(range(start, len(numels))))
    return out


def _ring_bytes(flat: torch.Tensor, compression: Compressor, n: int) -> int:
    """Bytes a rank sends in a ring allreduce of ``flat`` (``2 (n-1)/n`` of the wire payload)."""
    wire = compression.wire_dtype if compression.applies_to(flat) else flat.dtype
    itemsize = torch.empty((), dtype=wire).element_size()
    return 2 * (n - 1) * flat.numel() * itemsize // max(1, n)

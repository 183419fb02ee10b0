"""The gradient-sync options every front end takes, checked in one place: :class:`SyncOptions`.

The torch ``DistributedOptimizer``, ``HorovodStrategy`` and the Keras ``DistributedOptimizer``
take overlapping options (the reduce op, the wire compression or ``"auto"``, the ZeRO stage,
local steps and their outer optimizer). Which combinations run is decided here only, one message
per conflict, each with a HINT; a front end passes what the user gave, its own exception class,
what it can run (``allow_adasum``, ``zero2_with_accumulation``) and its own parameter names
(``names``: the strategy's ``outer_fragments`` is the outer loop's ``fragments``). What needs the
model, the inner optimizer or the backend (named parameters, sparse gradients, Keras' loss
scaling) stays in the front end.

The torch ``LocalSGD`` and the Keras ``LocalSGDCallback`` take only the outer-loop part:
:func:`local_steps_config`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from hvd_trainer.comm.ops.compression import AUTO, Compression, Compressor
from hvd_trainer.comm.ops.ops import ReduceOp
from hvd_trainer.comm.ops.optimizer_args import check_optimizer_args
from hvd_trainer.comm.reduce.bucket_hooks import refuse_with_hook
from hvd_trainer.comm.reduce.localsgd.outer import (
    LocalSGDConfig,
    LocalSGDConfigError,
    OuterArgs,
    refuse_fragments_with_auto,
)
from hvd_trainer.comm.zero.stage import check_overlap_arg, check_zero_stage

__all__ = ["SyncOptions", "local_steps_config", "is_auto"]

_NO_NAMES: Mapping[str, str] = MappingProxyType({})


def is_auto(value: Any) -> bool:
    """Whether ``value`` is the string ``"auto"`` (any case) of ``compression=`` / ``sync_every=``."""
    return isinstance(value, str) and value.lower() == AUTO


def _renamed(message: str, names: Mapping[str, str]) -> str:
    """``message`` with each outer-loop argument spelled as the front end names it."""
    for ours, theirs in names.items():
        message = re.sub(rf"(?<![\w.]){re.escape(ours)}=", f"{theirs}=", message)
    return message


def local_steps_config(
    sync_every: Any, outer: OuterArgs, compression: Any, *, error: type[Exception],
    names: Mapping[str, str] = _NO_NAMES,
) -> tuple[LocalSGDConfig | None, bool]:
    """The outer loop's settings for ``sync_every``, and whether it is ``"auto"``.

    Args:
        sync_every: ``None`` (no local steps), an int ``H >= 1`` or ``"auto"``.
        outer: the outer optimizer as given.
        compression: the outer gradient's wire format (a ``compression=`` value: ``None``, a
            spelling or a compressor; :class:`LocalSGDConfig` resolves it).
        error: the front end's exception class.
        names: the front end's spelling of outer-loop arguments (``{"fragments":
            "outer_fragments"}``): messages use it.

    Returns:
        ``(config, auto)``: with ``"auto"``, ``config`` has a placeholder period (the smallest
        the overlap fits in: every other setting is checked now, the period once auto chose it
        with :meth:`SyncOptions.local_for`); ``None`` without local steps.

    Raises:
        error: an invalid setting or combination (:class:`LocalSGDConfig`'s checks; ``fragments``
            other than 1 with ``"auto"``), the message naming the argument as the front end does.
    """
    auto = is_auto(sync_every)
    if sync_every is None:
        return None, False
    try:
        if auto:
            refuse_fragments_with_auto(outer.fragments)
        placeholder = outer.overlap_steps + 1 if isinstance(outer.overlap_steps, int) else 1
        return LocalSGDConfig.from_outer(placeholder if auto else sync_every, outer, compression), auto
    except LocalSGDConfigError as exc:
        raise error(_renamed(str(exc), names)) from None


@dataclass(frozen=True, kw_only=True)
class SyncOptions:
    """A front end's gradient-sync options, checked (build with :meth:`check`)."""

    compression: Compressor
    """The gradients' (with local steps: the outer gradient's) wire format; ``Compression.none``
    while ``"auto"`` measures."""
    auto_compression: bool
    """``compression="auto"``: chosen from the measured link and step."""
    op: ReduceOp
    """``ReduceOp.AVERAGE``, ``SUM`` or (torch only) ``ADASUM``."""
    backward_passes_per_step: int
    """Backward passes accumulated locally per update (>= 1)."""
    gradient_predivide_factor: float
    """> 0; other than 1.0 only with ``AVERAGE``."""
    zero_stage: int
    """0 (no sharding), 1 or 2."""
    zero_overlap_exchange: bool
    """ZeRO's parameter exchange overlapped with the next forward."""
    local: LocalSGDConfig | None
    """The outer loop of local steps; ``None``: synchronous, or ``sync_every="auto"`` (its loop,
    once chosen: :meth:`local_for`)."""
    auto_sync_every: bool
    """``sync_every="auto"``: auto may choose local steps and their period."""
    outer: OuterArgs = field(default_factory=OuterArgs)
    """The outer optimizer as given (kept for the period auto chooses)."""
    error: type[Exception] = ValueError
    """The front end's exception class (raised by :meth:`local_for` too)."""
    names: Mapping[str, str] = field(default_factory=lambda: _NO_NAMES)
    """The front end's spelling of outer-loop arguments."""

    @property
    def asked(self) -> dict[str, bool]:
        """Which settings are ``"auto"`` (:class:`~hvd_trainer.comm.reduce.auto.AutoMode`'s ``asked``)."""
        return {"compression": self.auto_compression, "sync_every": self.auto_sync_every}

    @property
    def any_auto(self) -> bool:
        """Whether anything is left to ``"auto"``."""
        return self.auto_compression or self.auto_sync_every

    def local_for(self, sync_every: int, compression: Compressor | None = None) -> LocalSGDConfig:
        """The outer loop at the period ``sync_every`` (auto's choice), with the outer optimizer
        as given and the outer gradient in ``compression`` (default: :attr:`compression`).

        Raises:
            :attr:`error`: the combination is invalid (the message names the argument).
        """
        config, _ = local_steps_config(sync_every, self.outer, compression or self.compression,
                                       error=self.error, names=self.names)
        assert config is not None
        return config

    @classmethod
    def check(
        cls, *, error: type[Exception], compression: Any = None, op: Any = None,
        backward_passes_per_step: Any = 1, gradient_predivide_factor: Any = 1.0,
        zero_stage: Any = 0, zero_overlap_exchange: Any = False, sync_every: Any = None,
        outer: OuterArgs | None = None, groups: bool = False, allow_adasum: bool = False,
        zero2_with_accumulation: bool = True, names: Mapping[str, str] = _NO_NAMES,
        comm_hook: str | None = None, comm_state: Any = None,
    ) -> SyncOptions:
        """Check the options as a user gave them; the one place their combinations are decided.

        Args:
            error: the front end's exception class (a ``ValueError`` subclass).
            compression: ``None``, a spelling or compressor (:meth:`Compression.resolve`), or
                ``"auto"``.
            op, backward_passes_per_step, gradient_predivide_factor: Horovod's reduction
                arguments (:func:`~hvd_trainer.comm.ops.optimizer_args.check_optimizer_args`).
            zero_stage, zero_overlap_exchange: ZeRO sharding.
            sync_every: ``None``, an int ``H >= 1`` or ``"auto"``: local steps.
            outer: the outer optimizer (``None``: the defaults); refused away from its defaults
                without ``sync_every``.
            groups: the user gave explicit allreduce groups (``groups=``/``num_groups=``).
            allow_adasum: the front end runs ``op=Adasum`` (the torch optimizer).
            zero2_with_accumulation: the front end reduce-scatters accumulated gradients (torch,
                Lightning); Keras reduces an accumulation window with one allreduce.
            names: the front end's spelling of outer-loop arguments, for messages.
            comm_hook: the user gave a DDP-style communication hook; its argument as the front
                end spells it (``"ddp_comm_hook"``), for messages (:meth:`refuse_comm_hook`).
            comm_state: that hook's state.

        Raises:
            error: a bad value or an unsupported combination, the message naming what was asked
                and a HINT. UnsupportedOpError: ``op=Adasum`` where the front end cannot run it.
        """
        args = check_optimizer_args(op, backward_passes_per_step, gradient_predivide_factor,
                                    error=error, allow_adasum=allow_adasum)
        auto_c, auto_h = is_auto(compression), is_auto(sync_every)
        comp = Compression.resolve(None if auto_c else compression, error=error,
                                   allow_error_feedback=True, allow_auto=True)
        stage = check_zero_stage(zero_stage, error)
        check_overlap_arg(stage, zero_overlap_exchange, error)
        outer = OuterArgs() if outer is None else outer
        asked = f"compression={'auto' if auto_c else comp.name!r}"  # as a user spells it
        if args.op is ReduceOp.ADASUM:
            if comp.error_feedback or auto_c:
                raise error(
                    f"{asked} with op=Adasum: Adasum combines whole vectors (gradients, or the torch "
                    "optimizer's weight changes) by their dot products and has no error feedback (and "
                    "'auto' may choose PowerSGD). HINT: use op=Average, or compression 'none', 'fp16' "
                    "or 'bf16' with Adasum."
                )
            if stage:
                raise error(f"zero_stage={stage} with op=Adasum: Adasum combines whole vectors on "
                            "every rank, which ZeRO shards between owners. HINT: use op=Average with ZeRO.")
        if auto_c and sync_every is not None and not auto_h:
            raise error(
                f"compression='auto' with sync_every={sync_every!r}: auto chooses the gradients' "
                "wire format, and local steps reduce no gradients. HINT: sync_every='auto' too "
                "(auto then chooses local steps or a compression), or give the outer gradient's "
                "compression ('none', 'bf16' or 'int8') with sync_every."
            )
        if sync_every is None:
            changed = outer.changed()
            if changed:
                given = ", ".join(f"{names.get(k, k)}={v!r}" for k, v in changed.items())
                raise error(
                    f"{given} set without sync_every: the outer loop runs only with local steps, "
                    "so this would change nothing. HINT: add sync_every=32 (or sync_every='auto'), "
                    "or drop it."
                )
        local, _ = local_steps_config(sync_every, outer, comp, error=error, names=names)  # checked
        local = None if auto_h else local
        if stage:
            auto = "compression='auto'" if auto_c else "sync_every='auto'" if auto_h else None
            cls._check_zero(stage, comp, asked, auto=auto, sync_every=sync_every, groups=groups,
                            passes=args.backward_passes_per_step,
                            zero2_with_accumulation=zero2_with_accumulation, error=error)
        opts = cls(compression=comp, auto_compression=auto_c, op=args.op,
                   backward_passes_per_step=args.backward_passes_per_step,
                   gradient_predivide_factor=args.gradient_predivide_factor, zero_stage=stage,
                   zero_overlap_exchange=bool(zero_overlap_exchange), local=local, auto_sync_every=auto_h,
                   outer=outer, error=error, names=MappingProxyType(dict(names)))
        if comm_hook is not None:
            opts.refuse_comm_hook(comm_hook, groups=groups, sync_every=sync_every, state=comm_state)
        return opts

    def refuse_comm_hook(self, spelled: str, *, groups: bool, sync_every: Any = None,
                         state: Any = None) -> None:
        """Refuse what a DDP-style communication hook does not run with (it replaces the
        bucket's reduction and averages it itself: :mod:`hvd_trainer.comm.reduce.bucket_hooks`).

        Args:
            spelled: the hook's argument as the front end names it (``"ddp_comm_hook"``).
            groups: the user gave explicit allreduce groups.
            sync_every: the ``sync_every`` given (``None``: synchronous).
            state: the hook's state (a ``PostLocalSGDState`` is refused).

        Raises:
            :attr:`error`: an option the hook would silently override, with a HINT.
        """
        error = self.error
        if sync_every is not None:
            raise error(f"{spelled} with sync_every={sync_every!r}: local steps reduce no gradients, "
                        "so the hook would never run. HINT: drop the hook, or drop sync_every=.")
        if self.auto_compression:
            raise error(f"{spelled} with compression='auto': the hook reduces every gradient bucket "
                        "itself, so auto has nothing to choose. HINT: drop the hook, or drop "
                        "compression=.")
        if type(state).__name__ == "PostLocalSGDState":
            raise error(
                f"{spelled} with a PostLocalSGDState: post-local SGD also needs DDP's periodic model "
                "averager, which is not run here, so the ranks would drift apart. HINT: use local "
                "steps (HorovodStrategy(sync_every=H) or hvd_trainer.torch.LocalSGD; with "
                "outer_lr=1.0 and outer_momentum=0.0 they average the models every H steps, after "
                "sync_warmup_steps synchronous ones)."
            )
        refuse_with_hook(self.op, self.compression, spelled=spelled, error=error)
        if self.zero_stage:
            raise error(f"{spelled} with zero_stage={self.zero_stage}: ZeRO shards the buckets "
                        "between their owners, which a hook does not know. HINT: drop the hook or "
                        "use zero_stage=0.")
        if groups:
            raise error(f"{spelled} with groups: grouped buckets are reduced by several reducers, "
                        "whose bucket indices a hook's state would mix. HINT: drop groups= or "
                        "num_groups= with a hook.")

    @staticmethod
    def _check_zero(stage: int, comp: Compressor, asked: str, *, auto: str | None, sync_every: Any,
                    groups: bool, passes: int, zero2_with_accumulation: bool,
                    error: type[Exception]) -> None:
        """Refuse what ZeRO (``stage`` 1 or 2) does not run with; ``auto``: the option left to
        ``"auto"`` (``"compression='auto'"``), if any."""
        if auto is not None:
            why = ("auto may choose PowerSGD, whose error feedback keeps per-rank residuals of whole "
                   "gradients, which ZeRO does not hold" if auto.startswith("compression") else
                   "auto may choose local steps, which average parameter changes: no gradients to shard")
            raise error(f"zero_stage={stage} with {auto}: {why}. HINT: use compression='none' or "
                        "'bf16' with ZeRO.")
        if sync_every is not None:
            raise error(
                f"zero_stage={stage} with sync_every={sync_every!r}: local steps average parameter "
                "changes, no gradients, so there is nothing to shard. HINT: zero_stage=0 with "
                "sync_every, or drop sync_every."
            )
        if comp.error_feedback:
            raise error(
                f"zero_stage={stage} with {asked}: error feedback keeps per-rank residuals of whole "
                "gradients, which ZeRO does not hold. HINT: use compression='none' or 'bf16' with ZeRO."
            )
        if stage == 2 and getattr(comp, "needs_global_scale", False):
            raise error(
                f"zero_stage=2 with {asked}: the fp16 global scale is not applied to the "
                "reduce-scatter. HINT: use compression='bf16', or zero_stage=1."
            )
        if groups:
            raise error(f"zero_stage={stage} with groups: the shard plan follows the fused buckets. "
                        "HINT: drop groups=/num_groups= with ZeRO.")
        if stage == 2 and passes > 1 and not zero2_with_accumulation:
            raise error(
                f"zero_stage=2 with backward_passes_per_step={passes}: the accumulated gradients are "
                "reduced once per window by an allreduce, not reduce-scattered. HINT: use "
                "zero_stage=1 with gradient accumulation (same optimizer-state sharding)."
            )

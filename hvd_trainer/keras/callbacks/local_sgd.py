"""DiLoCo-style local steps for ``model.fit``: each rank trains alone, the ranks synchronise the
weights every ``sync_every`` batches with an outer Nesterov SGD (see
:mod:`hvd_trainer.comm.reduce.localsgd.outer` for the algorithm)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import keras
import numpy as np
import torch

from hvd_trainer.comm import (
    AutoChoice,
    AutoMode,
    Compression,
    LocalSGDConfig,
    LocalSGDConfigError,
    OuterArgs,
    OuterSync,
    get_world,
    local_steps_config,
    resolve_set,
)
from hvd_trainer.keras.callbacks.broadcast import broadcast_variables

__all__ = ["LocalSGDCallback"]


class LocalSGDCallback(keras.callbacks.Callback):
    """Local steps: no gradient is reduced; every ``sync_every`` training batches the ranks average
    their weight change since the last synchronisation and an outer SGD applies it.

    Compile the model with the plain Keras optimizer (not ``DistributedOptimizer``).

    Example:
        >>> model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse")
        >>> model.fit(x_shard, y_shard, callbacks=[hvd_keras.callbacks.LocalSGDCallback(sync_every=32)])

    At the start of training rank 0's weights are broadcast (the ranks must start from the same
    anchor), and the first ``sync_warmup_steps`` batches are each followed by an average of the
    weights; ``fit`` ends with an outer step for the batches since the last one (and finishes one
    still on the wire, with ``overlap_steps``), so the ranks end with equal weights.
    ``sync_every=1, outer_lr=1.0, outer_momentum=0.0`` with SGD is synchronous data parallel. The
    trainable weights travel through numpy/torch on the host once per outer step, its launch and
    finish with ``overlap_steps``, and once per warm-up batch (both backends).
    ``state_dict()``/``load_state_dict()`` hold the anchors, the outer momentum and the counters
    (save them with the model to resume; an outer step still on the wire is finished first).

    In-process recovery (``hvdrun --recovery in-process``): the outer loop belongs to the world it
    started in. The first ``fit`` in a new world starts it again on every rank, as at the start of
    training (the survivors drop their anchors, outer momentum and counters; a restarted worker
    has none): rank 0's weights are broadcast and become the anchors, and the synchronous warm-up
    runs again on every rank (the same steps everywhere: a restarted worker knows nothing of the
    last world).

    ``sync_every="auto"`` chooses ``H`` with the rule every front end uses
    (:mod:`hvd_trainer.comm.reduce.auto`; rank 0 prints one line): on one host, no local steps;
    across hosts, the first training batches are timed while the weights are averaged after
    each one (synchronous), then either local steps start from those equal weights (with the
    outer settings given here) or the averaging after every batch goes on (in bf16 when the
    rule chose bf16). A resumed run takes up the saved period instead of measuring again.

    Args:
        sync_every: training batches per outer step (``H``), or ``"auto"``.
        outer_lr, outer_momentum, nesterov: the outer SGD (DiLoCo: 0.7, 0.9, True).
        compression: wire format of the outer gradient: ``None`` (fp32), ``"fp16"``, ``"bf16"``
            or ``"int8"`` (block-quantised allgather, ~4x fewer bytes at 2 ranks, no error
            feedback; :mod:`hvd_trainer.comm.reduce.localsgd.outer`).
        overlap_steps: training batches the outer gradient's allreduce may stay on the wire while
            training goes on (``0 <= overlap_steps < sync_every``; 0 blocks at every outer step);
            each rank then loads the new anchor plus its own change since the launch (the hidden
            outer step of :mod:`hvd_trainer.comm.reduce.localsgd.outer`). Not with ``"int8"``.
            With ``fragments``: ``overlap_steps < sync_every / fragments``.
        fragments: parts of the weights (consecutive, of about equal size) with outer steps of
            their own, one part's launched every ``sync_every / fragments`` batches, so each
            outer reduction moves ``1/fragments`` of the bytes (Streaming DiLoCo). Must divide
            ``sync_every``; 1 (the default): all at once. Not with ``sync_every="auto"``.
        sync_warmup_steps: training batches at the start after each of which the weights are
            averaged, before local steps begin (``None``: 128; 0: none; the
            synchronous warm-up of :mod:`hvd_trainer.comm.reduce.localsgd.outer`).

    Raises:
        LocalSGDConfigError: an invalid setting (``powersgd`` as ``compression`` included).
    """

    def __init__(self, sync_every: int | str, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, compression: Any = None, *, overlap_steps: int = 0,
                 fragments: int = 1, sync_warmup_steps: int | None = None) -> None:
        super().__init__()
        outer = OuterArgs(outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
                          overlap_steps=overlap_steps, fragments=fragments,
                          sync_warmup_steps=sync_warmup_steps)
        if sync_every is None:
            raise LocalSGDConfigError("sync_every=None: LocalSGDCallback runs local steps. HINT: "
                                      "sync_every=32, or 'auto'; synchronous training is "
                                      "hvd_trainer.keras.DistributedOptimizer.")
        # with "auto", a placeholder period: the outer settings are checked now
        config, self._auto_asked = local_steps_config(sync_every, outer, compression,
                                                      error=LocalSGDConfigError)
        assert config is not None
        self.config = config
        self._auto: AutoMode | None = None
        self._outer: OuterSync | None = None
        self._vars: list[Any] = []
        self._mirrors: list[torch.Tensor] = []
        self._pending: dict[str, Any] | None = None
        self._world: Any = None  # the world the outer loop started in

    @property
    def outer(self) -> OuterSync | None:
        """The outer loop (after the start of training; with ``"auto"``, while measuring or
        after a synchronous choice, one that averages the weights after every batch)."""
        return self._outer

    @property
    def sync_every(self) -> int | None:
        """Training batches per outer step (1: synchronous; ``None`` before training starts)."""
        return None if self._outer is None else self._outer.config.sync_every

    def _averaging(self, compression: Any) -> LocalSGDConfig:
        """The synchronous loop of ``"auto"``: the weights averaged after every batch."""
        return LocalSGDConfig(sync_every=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False,
                              compression=compression, sync_warmup_steps=0)

    def _take_auto(self, choice: AutoChoice) -> None:
        """The loop ``"auto"`` chose, anchored at the weights now (equal on every rank)."""
        local = choice.sync_every is not None
        config = replace(self.config, sync_every=choice.sync_every) if local else \
            self._averaging(choice.compression)
        self._outer = OuterSync(self._mirrors, config, world=self._world)

    def _start(self) -> None:
        self._world = get_world()
        broadcast_variables(self.model.weights, root_rank=0)
        self._vars = list(self.model.trainable_weights)
        self._mirrors = [torch.from_numpy(np.array(self._read(v), dtype=np.float32)) for v in self._vars]
        for m in self._mirrors:
            m.requires_grad_(True)
        pending, self._pending = self._pending, None
        if not self._auto_asked:
            self._outer = OuterSync(self._mirrors, self.config, world=self._world)
        else:
            grad_bytes = sum(m.numel() for m in self._mirrors) * 4  # fp32 on the wire
            self._auto = AutoMode(self._world, resolve_set(None, self._world, "sync_every=auto"),
                                  torch.device("cpu"), grad_bytes, asked={"sync_every": True})
            if self._auto.measuring and pending and pending.get("sync_every", 1) > 1:
                # saved after "auto" chose local steps: take up that period, measure nothing
                self._auto.adopt(AutoChoice(Compression.none, int(pending["sync_every"]), "resumed"))
            if self._auto.measuring:
                self._outer = OuterSync(self._mirrors, self._averaging(None), world=self._world)
            else:
                self._take_auto(self._auto.choice)
            if self._auto.measuring or self._auto.choice.sync_every is None:
                pending = None  # a synchronous loop holds nothing to take up
        if pending is not None:
            self._outer.load_state_dict(pending)

    @staticmethod
    def _read(var: Any) -> np.ndarray:
        return np.asarray(keras.ops.convert_to_numpy(var.value))

    def _sync(self, step: Callable[[], Any]) -> None:
        """Copy the weights into the mirrors, run ``step`` (the outer loop's), copy them back."""
        with torch.no_grad():
            for m, v in zip(self._mirrors, self._vars, strict=True):
                m.copy_(torch.from_numpy(np.asarray(self._read(v), dtype=np.float32)))
        step()
        for v, m in zip(self._vars, self._mirrors, strict=True):
            v.assign(m.detach().numpy().astype(v.dtype))

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._outer is not None and self._world is not get_world():  # in-process recovery
            self._outer = None  # and "auto" measures again, in the new world
        if self._outer is None and self.model.built:
            self._start()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._outer is None:  # a model built by its first step (TensorFlow, subclassed)
            self._start()
            return
        measuring = self._auto is not None and self._auto.measuring
        if self._outer.due():  # a warm-up average or an outer step: the weights change
            with self._auto.waiting() if measuring else contextlib.nullcontext():
                self._sync(self._outer.after_inner_step)
        else:
            self._outer.after_inner_step()
        if measuring:
            choice = self._auto.step_end(self._world)
            if choice is not None:
                self._take_auto(choice)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._outer is not None and self._outer.unsettled:
            self._sync(self._outer.settle)  # equal weights on every rank

    def state_dict(self) -> dict[str, Any]:
        """The outer state (anchors, outer momentum, counters); empty before training started."""
        if self._outer is None:
            return {}
        if self._outer.in_flight:  # finished here, so the weights get its result too
            self._sync(self._outer.finish_in_flight)
        return self._outer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (applied when training starts, if not yet)."""
        if self._outer is None:
            self._pending = state
        else:
            self._outer.load_state_dict(state)

"""Elastic state of a Keras 3 model and optimizer (any backend), for :func:`elastic.run`.

Example::

    state = KerasState(model, epoch=0)        # model.optimizer is captured too
    state.commit(); state.restore(); state.sync()
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hvd_trainer.comm import World, broadcast_object
from hvd_trainer.elastic.state import State

__all__ = ["KerasState"]


class KerasState(State):
    """Commit/restore/sync a Keras model's weights and its optimizer's variables as numpy arrays.

    The optimizer is built (for ``model.trainable_variables``) before a snapshot is taken or
    applied, so ``sync()`` works when some ranks have trained and others start with a fresh,
    unbuilt optimizer (a restarted worker). An hvd_trainer ``DistributedOptimizer`` with an
    error-feedback compression (``"int8"``, ``"powersgd:R"``) has its residuals (and PowerSGD's
    ``Q``) committed and restored too (training state; ``sync()`` gives every rank rank 0's, as
    ``TorchState`` does with the torch optimizer's ``state_dict``). With
    ``backward_passes_per_step > 1`` loading a snapshot (``restore()``, ``sync()``) empties its
    gradient-accumulation window, on every rank alike. With ``zero_stage`` a commit gathers every
    rank's shard of the optimizer state (a collective), and loading it plans the shards for the
    world of that moment (see ``DistributedOptimizer.load_full_state``): a commit made by 2 ranks
    is restored by 1 after an in-process re-form, and by 2 again when a worker joins; ``sync()``
    sends the root's last commit of it (or the shards gathered then, before any commit). Besides the
    process's random generators (see :class:`~hvd_trainer.elastic.state.State`), a commit keeps
    the model's Keras seed generator states (``Dropout`` and other random layers), which
    ``restore()`` sets back on this rank only.

    Args:
        model: a built ``keras.Model``.
        optimizer: defaults to ``model.optimizer``; ``None`` when the model is not compiled.
        backend: accepted for Horovod's signature (``KerasState(model, optimizer, backend)``)
            and unused: Keras 3 variables are read and assigned through their own API.
        **extra: further named values (epoch, batch, ...).

    Raises:
        TypeError: ``model`` has no ``get_weights``/``set_weights``.
        ValueError: a snapshot's variable count does not match (different model/optimizer).
    """

    def __init__(self, model: Any, optimizer: Any | None = None, backend: Any = None, **extra: Any) -> None:
        if not all(callable(getattr(model, name, None)) for name in ("get_weights", "set_weights")):
            raise TypeError(
                f"KerasState needs a keras.Model (get_weights/set_weights), got {type(model).__name__}. "
                "HINT: pass the model, or use TorchState for torch modules."
            )
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._sync_full: dict[str, np.ndarray] | None = None
        """ZeRO: the full optimizer state the sync root's capture sends (see :meth:`_before_sync`)."""
        super().__init__(**extra)

    def _ensure_optimizer_built(self) -> None:
        """Build the optimizer for the model's trainable variables if it is not built yet.

        An unbuilt Keras optimizer has only ``iterations`` and ``learning_rate``; building it
        first makes every snapshot (and every rank's, for ``sync()``) hold the full set, so a
        fresh rank can receive a trained rank's state.
        """
        opt = self.optimizer
        if opt is not None and not opt.built and self.model.trainable_variables:
            opt.build(self.model.trainable_variables)

    def _sharding(self) -> bool:
        """The optimizer is an hvd_trainer ``DistributedOptimizer`` built with ``zero_stage``."""
        return bool(getattr(self.optimizer, "zero_stage", 0))

    def _before_sync(self, world: World, root_rank: int) -> None:
        """ZeRO: gathering the shards is a collective, and ``sync()`` captures on the root only.
        So the root sends its last commit's full state when it has one (a survivor after a
        re-form: its shards are planned for a world that is gone); else every rank gathers the
        shards now, for the root's capture."""
        self._sync_full = None
        if self.optimizer is None or not self._sharding():
            return
        root = world.rank == root_rank
        has_commit = self._saved is not None if root else None
        if broadcast_object(has_commit, root_rank=root_rank, name="elastic.KerasState.zero", world=world):
            if root:
                assert self._saved is not None
                self._sync_full = self._saved["__optimizer__"]
            return
        self._ensure_optimizer_built()
        full = self.optimizer.full_state()
        self._sync_full = full if root else None

    def _optimizer_values(self) -> list[np.ndarray] | dict[str, np.ndarray]:
        if self.optimizer is None:
            return []
        self._ensure_optimizer_built()
        if self._sharding():  # every rank's shard, by name: loadable in a world of any size
            full, self._sync_full = self._sync_full, None
            return self.optimizer.full_state() if full is None else full
        return [np.array(v.numpy(), copy=True) for v in self.optimizer.variables]

    def _seed_variables(self) -> list[Any]:
        """The model's seed generator states (``keras.random.SeedGenerator``'s variable, named
        ``seed_generator_state``; not among the weights)."""
        weights = {id(w) for w in self.model.weights}
        return [v for v in getattr(self.model, "variables", [])
                if id(v) not in weights and str(getattr(v, "name", "")).endswith("seed_generator_state")]

    def _capture_rng(self) -> Any:
        seeds = [np.array(v.numpy(), copy=True) for v in self._seed_variables()]
        return {"process": super()._capture_rng(), "keras_seeds": seeds}

    def _restore_rng(self, states: Any) -> None:
        super()._restore_rng(states["process"])
        variables = self._seed_variables()
        if len(variables) == len(states["keras_seeds"]):
            for variable, value in zip(variables, states["keras_seeds"], strict=True):
                variable.assign(value)

    def _capture(self) -> dict[str, Any]:
        out = super()._capture()
        out["__weights__"] = [np.array(w, copy=True) for w in self.model.get_weights()]
        out["__optimizer__"] = self._optimizer_values()
        out["__compression__"] = self._compression_state()
        return out

    def _compression_state(self) -> dict[str, Any] | None:
        """Copies of the optimizer's error-feedback state (``None`` where it keeps none)."""
        get = getattr(self.optimizer, "compression_state_dict", None)
        return get() if callable(get) else None

    def _apply(self, snapshot: dict[str, Any]) -> None:
        super()._apply(snapshot)
        self.model.set_weights([np.array(w, copy=True) for w in snapshot["__weights__"]])
        values = snapshot["__optimizer__"]
        if self.optimizer is None or not values:
            return
        self._ensure_optimizer_built()
        if isinstance(values, dict):  # a ZeRO optimizer's full state: sharded anew for this world
            if not self._sharding():
                raise ValueError(
                    "KerasState snapshot holds a zero_stage optimizer's state, the optimizer has no "
                    "zero_stage. HINT: restore into the same model/optimizer configuration."
                )
            self.optimizer.load_full_state(values)
        else:
            self._assign_optimizer(values, snapshot.get("__compression__"))
        clear = getattr(self.optimizer, "clear_accumulated_gradients", None)
        if callable(clear):  # a partly filled window holds gradients of steps after the commit
            clear()

    def _assign_optimizer(self, values: list[np.ndarray], feedback: dict[str, Any] | None) -> None:
        variables = self.optimizer.variables
        if len(variables) != len(values):
            raise ValueError(
                f"KerasState snapshot has {len(values)} optimizer variables, the optimizer has "
                f"{len(variables)}. HINT: restore into the same model/optimizer configuration."
            )
        for variable, value in zip(variables, values, strict=True):
            variable.assign(value)
        if feedback is not None and callable(getattr(self.optimizer, "load_compression_state_dict", None)):
            self.optimizer.load_compression_state_dict(feedback)

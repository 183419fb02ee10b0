"""``ModelCheckpoint`` that writes on rank 0 only."""

from __future__ import annotations

import keras

from hvd_trainer.comm import World, get_world

__all__ = ["BestModelCheckpoint"]


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keep the best model seen so far (``save_best_only=True``), written by rank 0 only.

    Same arguments as ``keras.callbacks.ModelCheckpoint`` except ``save_best_only`` (always
    True). Put :class:`MetricAverageCallback` before it so ``monitor`` is the average over
    ranks. Other ranks do nothing, so no two processes write the same file.

    Example:
        >>> BestModelCheckpoint(filepath="best.keras", monitor="val_loss")

    Args:
        world: the world whose rank 0 writes (default: the current one, looked up at every save,
            so after in-process recovery the new world's rank 0 writes).

    Raises:
        NotInitializedError: no ``world`` and ``hvd_trainer.init()`` has not run.
    """

    def __init__(self, filepath: str, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto", save_freq="epoch",
                 initial_value_threshold: float | None = None, *, world: World | None = None) -> None:
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq,
                         initial_value_threshold=initial_value_threshold)
        self._world = world
        if world is None:
            get_world()  # NotInitializedError now, not at the first save

    @property
    def world(self) -> World:
        """The world whose rank 0 writes: the one given, else the current one."""
        return get_world() if self._world is None else self._world

    def _is_writer(self) -> bool:
        return self.world.rank == 0

    # ModelCheckpoint saves only from these two hooks; other ranks skip them whole.
    def on_train_batch_end(self, batch, logs=None):
        if self._is_writer():
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self._is_writer():
            super().on_epoch_end(epoch, logs)

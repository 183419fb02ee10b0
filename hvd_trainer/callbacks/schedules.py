"""Learning-rate warmup and step-schedule formulas, shared by the Keras and Lightning callbacks.

Framework-neutral: plain floats in, plain floats out. Epochs are counted from 0; a fractional
epoch ``e + b / steps_per_epoch`` is batch ``b`` of epoch ``e``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ScheduleError", "LRWarmup", "LRSchedule", "fractional_epoch"]


class ScheduleError(ValueError):
    """An invalid schedule argument (the message echoes the value and gives a HINT)."""


def fractional_epoch(epoch: int, batch: int, steps_per_epoch: int) -> float:
    """``epoch + batch / steps_per_epoch``: the training progress in epochs at ``batch``.

    Raises:
        ScheduleError: ``steps_per_epoch`` is not a positive integer.
    """
    if steps_per_epoch is None or steps_per_epoch <= 0:
        raise ScheduleError(
            f"steps_per_epoch={steps_per_epoch!r} must be a positive integer. HINT: pass "
            "steps_per_epoch= to the callback when the data has no known length."
        )
    return epoch + batch / steps_per_epoch


@dataclass(kw_only=True, slots=True)
class LRWarmup:
    """Gradual warmup from ``initial_lr / size`` to ``initial_lr`` (Goyal et al. 2017,
    "Accurate, Large Minibatch SGD", arXiv:1706.02677, section 2.2).

    ``lr(t) = initial_lr / size * (t * (size - 1) / warmup_epochs + 1)`` for a fractional
    epoch ``0 <= t < warmup_epochs``; ``initial_lr`` from ``t = warmup_epochs`` on.
    ``initial_lr`` is the learning rate meant for the full (``size``-times larger) batch.
    """

    initial_lr: float
    """Target learning rate reached at the end of warmup."""
    warmup_epochs: float = 5.0
    """Length of the ramp, epochs (> 0)."""
    size: int
    """Number of processes (world size, >= 1)."""

    def __post_init__(self) -> None:
        if not self.initial_lr > 0:
            raise ScheduleError(f"initial_lr={self.initial_lr!r} must be > 0.")
        if not self.warmup_epochs > 0:
            raise ScheduleError(
                f"warmup_epochs={self.warmup_epochs!r} must be > 0. HINT: drop the warmup "
                "callback to train without warmup."
            )
        if self.size < 1:
            raise ScheduleError(f"size={self.size!r} must be >= 1.")

    def in_warmup(self, epoch: float) -> bool:
        """Whether the fractional ``epoch`` lies in ``[0, warmup_epochs)``."""
        return 0 <= epoch < self.warmup_epochs

    def lr_at(self, epoch: float) -> float:
        """Learning rate at the fractional ``epoch`` (``initial_lr`` after the warmup)."""
        if epoch >= self.warmup_epochs:
            return float(self.initial_lr)
        t = max(0.0, float(epoch))
        return self.initial_lr / self.size * (t * (self.size - 1) / self.warmup_epochs + 1.0)


@dataclass(kw_only=True, slots=True)
class LRSchedule:
    """``lr = initial_lr * factor(epoch)`` for epochs in ``[start_epoch, end_epoch)``.

    ``multiplier`` is either a float ``m``, Horovod's exponential decay
    ``factor(e) = m ** (e - start_epoch)`` (factor 1 at ``start_epoch``, ``m`` one epoch later),
    or a function ``f(epoch) -> factor``. With ``staircase`` (the default) the factor is taken at
    the integer epoch on its first batch; without it at the fractional epoch
    ``e + batch / steps_per_epoch`` on every batch (for a float ``m`` too, a smooth decay).
    Because the value is a closed form of the epoch, it is the same after resuming at any
    ``initial_epoch``. Outside ``[start_epoch, end_epoch)`` :meth:`lr_at` returns ``None``
    (leave the LR alone: it keeps the value of the last epoch inside the range).

    Example (Horovod's table): ``LRSchedule(initial_lr=1.0, multiplier=0.1, start_epoch=2,
    end_epoch=4)`` gives ``None, None, 1.0, 0.1, None, ...`` for epochs 0, 1, 2, 3, 4.
    """

    initial_lr: float
    multiplier: float | Callable[[float], float]
    start_epoch: int = 0
    end_epoch: int | None = None
    staircase: bool = True
    """Change the LR once per epoch (True) or every batch with a fractional epoch (False)."""

    def __post_init__(self) -> None:
        if not self.initial_lr > 0:
            raise ScheduleError(f"initial_lr={self.initial_lr!r} must be > 0.")
        if not callable(self.multiplier):
            if isinstance(self.multiplier, bool) or not isinstance(self.multiplier, int | float):
                raise ScheduleError(
                    f"multiplier={self.multiplier!r} must be a float or a function of the "
                    "epoch. HINT: multiplier=0.1 or multiplier=lambda epoch: 0.1 ** (epoch // 30)."
                )
            if not self.multiplier > 0:
                raise ScheduleError(f"multiplier={self.multiplier!r} must be > 0.")
        if self.start_epoch < 0:
            raise ScheduleError(f"start_epoch={self.start_epoch!r} must be >= 0.")
        if self.end_epoch is not None and self.end_epoch <= self.start_epoch:
            raise ScheduleError(
                f"end_epoch={self.end_epoch!r} must be > start_epoch={self.start_epoch!r} "
                "(or None for no end)."
            )

    def active(self, epoch: int) -> bool:
        """Whether the integer ``epoch`` lies in ``[start_epoch, end_epoch)``."""
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def factor(self, epoch: float) -> float:
        """The multiplier of ``initial_lr`` at ``epoch`` (see the class docstring)."""
        if callable(self.multiplier):
            return float(self.multiplier(epoch))
        return float(self.multiplier) ** (epoch - self.start_epoch)

    def lr_at(self, epoch: int, batch: int = 0, steps_per_epoch: int | None = None) -> float | None:
        """Learning rate for ``batch`` of ``epoch``; ``None`` when the LR must not change.

        With ``staircase`` the LR changes on batch 0 only; otherwise on every batch, using the
        fractional epoch (``steps_per_epoch`` required).
        """
        if not self.active(epoch):
            return None
        if self.staircase:
            return self.initial_lr * self.factor(epoch) if batch == 0 else None
        return self.initial_lr * self.factor(fractional_epoch(epoch, batch, steps_per_epoch))

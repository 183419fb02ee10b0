"""Local gradient accumulation for ``DistributedOptimizer(backward_passes_per_step=N)``.

Each ``apply()`` call adds its gradients into per-variable sums and counts one pass; the N-th
pass hands the sums to a callback (reduce over ranks + inner optimizer update) and zeroes them.
Semantics follow Horovod's ``LocalGradientAggregationHelper`` (graph) and ``...Eager``.

The state lives in plain objects (not Keras/TF trackables), so it is never written into a
saved model or a ``tf.train.Checkpoint``: a model saved with accumulation on loads with plain
Keras, and a partially filled window is not saved (it restarts empty after loading).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hvd_trainer.keras._compat import iterations_variable

__all__ = ["TFAccumulation", "TorchAccumulation", "iteration_variable"]


def iteration_variable(optimizer: Any) -> Any:
    """The step-counter variable of the innermost optimizer (below any ``LossScaleOptimizer``).

    ``Optimizer.iterations`` is a derived tensor when Keras' own ``gradient_accumulation_steps``
    is set, so the variable behind it is used when present.
    """
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    variable = iterations_variable(optimizer)
    return optimizer.iterations if variable is None else variable


class TFAccumulation:
    """Accumulators (one ``tf.Variable`` per trainable variable) and a pass counter.

    Args:
        variables: the Keras trainable variables, in ``apply()`` order.
        passes: N, the number of ``apply()`` calls per update (>= 2).
    """

    def __init__(self, variables: Sequence[Any], passes: int) -> None:
        import tensorflow as tf

        self.passes = passes
        with tf.init_scope():  # build() may run while a tf.function traces
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_pass_counter")
            self.sums = [
                tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name=f"hvd_grad_sum_{i}")
                for i, v in enumerate(variables)
            ]

    def step(self, grads: Sequence[Any], on_update: Callable[[list[Any]], None],
             on_accumulate: Callable[[], None]) -> None:
        """Add ``grads``; on the N-th pass call ``on_update(sums)`` then zero, else ``on_accumulate()``.

        Works eagerly and while ``tf.function`` traces (the branches become a ``tf.cond``, so
        whatever ``on_update`` does, e.g. a ``tf.numpy_function`` allreduce, runs only then).
        ``None`` gradients (static per trace) stay ``None`` in the list given to ``on_update``.
        """
        import tensorflow as tf

        idx = [i for i, g in enumerate(grads) if g is not None]
        for i in idx:
            self.sums[i].assign_add(tf.cast(tf.convert_to_tensor(grads[i]), self.sums[i].dtype))
        count = self.counter.assign_add(1)

        def update() -> None:
            summed: list[Any] = [None] * len(grads)
            for i in idx:
                summed[i] = self.sums[i].read_value()
            on_update(summed)
            for i in idx:
                self.sums[i].assign(tf.zeros_like(self.sums[i]))
            self.counter.assign(0)

        tf.cond(tf.equal(count, self.passes), update, on_accumulate)

    def reset(self) -> None:
        """Zero the sums and the pass counter (eagerly): a new window starts."""
        import tensorflow as tf

        for s in self.sums:
            s.assign(tf.zeros_like(s))
        self.counter.assign(0)


class TorchAccumulation:
    """Accumulators (one torch tensor per trainable variable), "used" flags and a pass counter.

    Args:
        variables: the Keras trainable variables (``.value`` is a torch Parameter).
        passes: N, the number of ``apply()`` calls per update (>= 2).
    """

    def __init__(self, variables: Sequence[Any], passes: int) -> None:
        import torch

        self.passes = passes
        self.count = 0
        self.sums = [torch.zeros_like(v.value, requires_grad=False) for v in variables]
        # 1.0 where a variable got a gradient in the current window; reduced with the sums so
        # a variable no rank produced a gradient for is given None (as in one process).
        self.used = torch.zeros(len(self.sums), dtype=self.sums[0].dtype if self.sums else torch.float32,
                                device=self.sums[0].device if self.sums else None)

    def add(self, grads: Sequence[Any]) -> bool:
        """Add ``grads`` (``None`` entries skipped); True when this was the N-th pass."""
        for i, g in enumerate(grads):
            if g is not None:
                self.sums[i].add_(g.detach())
                self.used[i] = 1.0
        self.count += 1
        return self.count >= self.passes

    def reset(self) -> None:
        """Zero the sums and flags and start a new window."""
        for s in self.sums:
            s.zero_()
        self.used.zero_()
        self.count = 0

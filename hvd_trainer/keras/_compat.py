"""The private Keras and TensorFlow internals hvd_trainer relies on, each one reached only here.

Only the Keras front end imports this module (it imports neither Keras nor, outside
:func:`in_xla_context` on the TensorFlow backend, TensorFlow). ``tests/unit/test_compat.py``
checks each entry against the installed Keras (torch backend) and TensorFlow, so an upgrade that
changes one fails that named test. Checked: Keras 3.15, TensorFlow 2.21.

===========================================================  ===================================
private name                                                  used for (by)
===========================================================  ===================================
``keras.optimizers.Optimizer._iterations``                    the step-counter variable behind
                                                              ``iterations`` (a derived tensor
                                                              when Keras' own
                                                              ``gradient_accumulation_steps`` is
                                                              set), counted up by passes that
                                                              only accumulate (keras/_accumulate)
``keras.optimizers.Optimizer._trainable_variables``           the variables ``build()`` got, for
                                                              ``apply(grads)`` without variables
                                                              (keras/optimizer.py)
``tensorflow.python.ops.control_flow_util``                   refusing to run the allreduce
``.GraphOrParentsInXlaContext(graph)``                        inside an XLA-compiled function
                                                              (keras/optimizer.py)
===========================================================  ===================================

Replaced by public API: ``ModelCheckpoint._save_model`` (``BestModelCheckpoint`` overrides the
public ``on_epoch_end`` / ``on_train_batch_end``, the only callers of ``_save_model``) and
``tensorflow.python.framework.ops.get_default_graph`` (``tf.compat.v1.get_default_graph``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["built_trainable_variables", "in_xla_context", "iterations_variable"]


def iterations_variable(optimizer: Any) -> Any | None:
    """The variable behind ``optimizer.iterations`` (``None`` if this Keras has none)."""
    return getattr(optimizer, "_iterations", None)


def built_trainable_variables(optimizer: Any) -> Sequence[Any]:
    """The variables ``optimizer.build(var_list)`` was given (after ``build``)."""
    return optimizer._trainable_variables


def in_xla_context() -> bool:
    """True while TensorFlow traces a function compiled with XLA (``jit_compile=True``).

    Uses TensorFlow's internal control-flow utility; returns False if it is unavailable.
    """
    try:
        import tensorflow as tf
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - TF layout changed
        return False
    graph = tf.compat.v1.get_default_graph()
    try:
        return bool(control_flow_util.GraphOrParentsInXlaContext(graph))
    except Exception:  # noqa: BLE001 - private API: never let a probe break training
        return False

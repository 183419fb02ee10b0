"""Average a dict of scalar metrics over ranks (Horovod's ``MetricAverageCallback`` maths)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch

from hvd_trainer.comm import World, allgather_object, allreduce_, get_world

__all__ = ["MetricKeysMismatchError", "average_metrics"]


class MetricKeysMismatchError(ValueError):
    """Ranks reported different metric names, so their values cannot be averaged."""


def _numeric(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Real):
        return True
    return getattr(value, "ndim", None) == 0 and getattr(value, "dtype", None) is not None


def average_metrics(
    values: Mapping[str, Any], *, world: World | None = None, check_keys: bool = True
) -> dict[str, float]:
    """Return the mean over ranks of every numeric scalar in ``values``.

    One allreduce of a float64 vector (keys in sorted order). Non-numeric entries are left out
    of the result. Every rank must call this with the same numeric keys.

    Args:
        values: metric name -> Python/numpy scalar (e.g. Keras epoch ``logs``).
        world: the world to average over (default: :func:`hvd_trainer.comm.get_world`).
        check_keys: gather every rank's key list first (one small object allgather) and raise
            a clear error on a mismatch instead of averaging unrelated numbers.

    Returns:
        ``{name: float}``: the averages, identical on every rank.

    Raises:
        MetricKeysMismatchError: ranks reported different numeric keys (each rank's list shown).
    """
    w = get_world() if world is None else world
    keys = sorted(k for k, v in values.items() if _numeric(v))
    if w.size == 1:
        return {k: float(values[k]) for k in keys}
    if check_keys:
        every = allgather_object(keys, world=w)
        if any(other != keys for other in every):
            listing = "; ".join(f"rank {r}: {ks}" for r, ks in enumerate(every))
            raise MetricKeysMismatchError(
                f"ranks logged different metrics, cannot average them ({listing}). HINT: give "
                "every rank the same metrics and callbacks, and put MetricAverageCallback "
                "after callbacks that add log entries on one rank only."
            )
    vec = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    allreduce_(vec, op="average", name="metric_average", world=w)
    return dict(zip(keys, vec.tolist(), strict=True))

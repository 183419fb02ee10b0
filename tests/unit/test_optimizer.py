"""DistributedOptimizer argument checks (they run before any process group is needed)."""

from __future__ import annotations

import pytest
import torch

import hvd_trainer as hvd
from hvd_trainer.torch.optimizer import OptimizerConfigError


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_named_parameters_duplicate_name() -> None:
    model, opt = _setup()
    named = list(model.named_parameters())
    named[1] = (named[0][0], named[1][1])
    with pytest.raises(ValueError, match="twice") as info:
        hvd.DistributedOptimizer(opt, named)
    assert isinstance(info.value, OptimizerConfigError)


def test_named_parameters_same_tensor_twice() -> None:
    model, opt = _setup()
    named = list(model.named_parameters()) + [("alias", model[0].weight)]
    with pytest.raises(OptimizerConfigError, match="'alias' twice"):
        hvd.DistributedOptimizer(opt, named)


def test_named_parameters_incomplete() -> None:
    model, opt = _setup()
    with pytest.raises(OptimizerConfigError, match=r"misses 2 parameter\(s\)"):
        hvd.DistributedOptimizer(opt, list(model[0].named_parameters()))


def test_named_parameters_not_tuples() -> None:
    model, opt = _setup()
    with pytest.raises(OptimizerConfigError, match="HINT: pass model.named_parameters"):
        hvd.DistributedOptimizer(opt, list(model.parameters()))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backward_passes_per_step": 0}, "backward_passes_per_step=0"),
        ({"op": hvd.Min}, "Average or Sum"),
        ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "needs op=Average"),
        ({"gradient_predivide_factor": 0.0}, "must be > 0"),
    ],
)
def test_invalid_options(kwargs: dict, match: str) -> None:
    _, opt = _setup()
    with pytest.raises(OptimizerConfigError, match=match):
        hvd.DistributedOptimizer(opt, **kwargs)


def test_not_an_optimizer() -> None:
    model, _ = _setup()
    with pytest.raises(TypeError, match="list"):
        hvd.DistributedOptimizer(list(model.parameters()))


def test_needs_init() -> None:
    if hvd.is_initialized():
        pytest.skip("a process group exists in this test process")
    _, opt = _setup()
    with pytest.raises(hvd.NotInitializedError, match="HINT"):
        hvd.DistributedOptimizer(opt)

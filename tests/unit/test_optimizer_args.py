"""check_optimizer_args: the argument checks shared by the torch and Keras DistributedOptimizer
(the torch front end here and in test_optimizer.py; Keras in test_keras_arguments.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hvd_trainer.comm.ops.ops import ReduceOp
from hvd_trainer.comm.ops.optimizer_args import (
    OptimizerArgs,
    OptimizerArgumentError,
    check_backward_passes_per_step,
    check_optimizer_args,
)

BAD = [
    ({"backward_passes_per_step": True}, "backward_passes_per_step=True must be an int >= 1"),
    ({"backward_passes_per_step": 0}, "backward_passes_per_step=0 must be an int >= 1"),
    ({"backward_passes_per_step": 2.0}, "backward_passes_per_step=2.0 must be an int >= 1"),
    ({"op": ReduceOp.MAX}, "Average or Sum"),
    ({"op": "min"}, "op='min' is not supported"),
    ({"gradient_predivide_factor": 0}, "gradient_predivide_factor=0 must be > 0"),
    ({"gradient_predivide_factor": -1.5}, "gradient_predivide_factor=-1.5 must be > 0"),
    ({"gradient_predivide_factor": "2"}, "gradient_predivide_factor='2' must be > 0"),
    ({"op": ReduceOp.SUM, "gradient_predivide_factor": 2.0}, "needs op=Average, got op=Sum"),
]


def _call(**kwargs: Any) -> OptimizerArgs:
    args = {"op": None, "backward_passes_per_step": 1, "gradient_predivide_factor": 1.0, **kwargs}
    return check_optimizer_args(args["op"], args["backward_passes_per_step"],
                                args["gradient_predivide_factor"])


def test_defaults_and_normalisation() -> None:
    assert _call() == OptimizerArgs(op=ReduceOp.AVERAGE, backward_passes_per_step=1,
                                    gradient_predivide_factor=1.0)
    got = _call(op="sum", backward_passes_per_step=4)
    assert got.op is ReduceOp.SUM and got.backward_passes_per_step == 4
    got = _call(op=torch.distributed.ReduceOp.AVG, gradient_predivide_factor=2)
    assert got.op is ReduceOp.AVERAGE and got.gradient_predivide_factor == 2.0
    assert isinstance(got.gradient_predivide_factor, float)


@pytest.mark.parametrize(("kwargs", "needle"), BAD)
def test_bad_arguments_echo_the_value_with_a_hint(kwargs: dict, needle: str) -> None:
    with pytest.raises(OptimizerArgumentError, match="HINT") as info:
        _call(**kwargs)
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def test_error_class_of_the_caller() -> None:
    class FrontEndError(ValueError):
        pass

    with pytest.raises(FrontEndError, match="backward_passes_per_step=True"):
        check_optimizer_args(None, True, 1.0, error=FrontEndError)
    with pytest.raises(FrontEndError, match="backward_passes_per_step=False"):
        check_backward_passes_per_step(False, error=FrontEndError)
    assert check_backward_passes_per_step(3) == 3


def test_adasum_keeps_its_own_error() -> None:
    with pytest.raises(NotImplementedError, match="Adasum"):
        _call(op=ReduceOp.ADASUM)  # the Keras optimizer does not run it; the torch one allows it


# -- the torch front end ------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "needle"), BAD)
def test_torch_optimizer_uses_the_shared_checks(kwargs: dict, needle: str) -> None:
    import hvd_trainer as hvd
    from hvd_trainer.torch.optimizer import OptimizerConfigError

    model = torch.nn.Linear(2, 1)
    with pytest.raises(OptimizerConfigError, match="HINT") as info:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert needle in str(info.value)
    assert isinstance(info.value, OptimizerArgumentError)


def test_torch_set_backward_passes_per_step_rejects_bool() -> None:
    import hvd_trainer as hvd
    from hvd_trainer.comm.world.world import World
    from hvd_trainer.torch.optimizer import OptimizerConfigError

    world = World(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                  device=torch.device("cpu"), backend="gloo")
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), world=world)
    with pytest.raises(OptimizerConfigError, match="backward_passes_per_step=True"):
        opt.set_backward_passes_per_step(True)
    opt.set_backward_passes_per_step(3)
    assert opt.backward_passes_per_step == 3

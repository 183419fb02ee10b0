"""check_zero_stage (hvd_trainer/comm/zero/stage.py): the one ``zero_stage`` check of the torch
DistributedOptimizer and the Lightning strategy here (the Keras one in test_keras_arguments.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from hvd_trainer.comm.world.world import World
from hvd_trainer.comm.zero import check_zero_stage

REFUSED = [
    ("2", "zero_stage must be an int 0, 1 or 2, got the str '2'. HINT: zero_stage=2 (an int)."),
    (" 1 ", "zero_stage must be an int 0, 1 or 2, got the str ' 1 '. HINT: zero_stage=1 (an int)."),
    (2.0, "zero_stage must be an int 0, 1 or 2, got the float 2.0. HINT: zero_stage=2 (an int)."),
    (True, "zero_stage must be an int 0, 1 or 2, got the bool True. HINT: zero_stage=0 (no sharding), 1 "
           "(optimizer state sharded) or 2 (optimizer state and averaged gradients sharded)."),
    ("two", "zero_stage must be an int 0, 1 or 2, got the str 'two'. HINT: zero_stage=0 (no sharding)"),
    (None, "zero_stage must be an int 0, 1 or 2, got the NoneType None. HINT: zero_stage=0 (no sharding)"),
    ("3", "zero_stage must be an int 0, 1 or 2, got the str '3'. HINT: zero_stage=0 (no sharding), 1"),
    (3, "zero_stage=3 must be 0 (no sharding), 1 (optimizer state sharded) or 2 (optimizer state and "
        "averaged gradients sharded). HINT: ZeRO stage 3 (sharded weights) is not implemented; use "
        "zero_stage=2."),
    (-1, "zero_stage=-1 must be 0 (no sharding), 1 (optimizer state sharded) or 2 (optimizer state and "
         "averaged gradients sharded). HINT: zero_stage=0, 1 or 2."),
]


class FrontEndError(ValueError):
    pass


@pytest.mark.parametrize(("value", "expected"), [(0, 0), (1, 1), (2, 2), (np.int64(2), 2)])
def test_ints_are_accepted_as_plain_ints(value: Any, expected: int) -> None:
    got = check_zero_stage(value, FrontEndError)
    assert got == expected and type(got) is int


@pytest.mark.parametrize(("value", "message"), REFUSED)
def test_refusals_name_the_type_and_the_fix(value: Any, message: str) -> None:
    with pytest.raises(FrontEndError) as info:
        check_zero_stage(value, FrontEndError)
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize(("value", "message"), REFUSED)
def test_strategy_uses_the_shared_check(value: Any, message: str) -> None:
    from hvd_trainer.strategy import HorovodStrategy, StrategyConfigError

    with pytest.raises(StrategyConfigError) as info:
        HorovodStrategy(zero_stage=value)
    assert str(info.value).startswith(message), str(info.value)


def test_strategy_stores_a_plain_int() -> None:
    from hvd_trainer.strategy import HorovodStrategy

    assert type(HorovodStrategy(zero_stage=np.int64(1))._zero_stage) is int


@pytest.mark.parametrize(("value", "message"), REFUSED)
def test_torch_optimizer_uses_the_shared_check(value: Any, message: str) -> None:
    import hvd_trainer as hvd
    from hvd_trainer.torch.optimizer import OptimizerConfigError

    world = World(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                  device=torch.device("cpu"), backend="gloo")
    model = torch.nn.Linear(2, 1)
    with pytest.raises(OptimizerConfigError) as info:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                 world=world, zero_stage=value)
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize(("compression", "message"), [
    ("auto", "zero_stage=2 with compression='auto': auto may choose PowerSGD"),
    ("int8", "zero_stage=2 with compression='int8': error feedback keeps per-rank residuals"),
])
def test_torch_optimizer_refuses_error_feedback_with_zero_naming_what_was_asked(compression: str,
                                                                                message: str) -> None:
    import hvd_trainer as hvd
    from hvd_trainer.torch.optimizer import OptimizerConfigError

    world = World(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                  device=torch.device("cpu"), backend="gloo")
    model = torch.nn.Linear(2, 1)
    with pytest.raises(OptimizerConfigError) as info:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                 world=world, zero_stage=2, compression=compression)
    assert str(info.value).startswith(message), str(info.value)
    assert "HINT: use compression='none' or 'bf16' with ZeRO." in str(info.value)

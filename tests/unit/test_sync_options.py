"""SyncOptions (hvd_trainer/comm/sync_options.py): the option matrix of every front end, checked
once. The torch ``DistributedOptimizer`` and ``HorovodStrategy`` refuse each conflict with the
same message (the Keras optimizer's refusals are run in tests/dist/test_keras_zero.py and
tests/unit/test_keras_arguments.py); the combinations they used to treat differently are now
refused by both."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

import hvd_trainer as hvd
from hvd_trainer.comm.reduce.localsgd import LocalSGDConfig, LocalSGDConfigError, OuterArgs
from hvd_trainer.comm.sync_options import SyncOptions, local_steps_config
from hvd_trainer.comm.world.world import World
from hvd_trainer.strategy import HorovodStrategy, StrategyConfigError
from hvd_trainer.torch.optimizer import OptimizerConfigError

ROOT = Path(__file__).resolve().parents[2]


class FrontEndError(ValueError):
    pass


def _world() -> World:
    return World(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                 device=torch.device("cpu"), backend="gloo")


def _torch_error(**kwargs: Any) -> str:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(OptimizerConfigError) as info:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                 world=_world(), **kwargs)
    return str(info.value)


def _strategy_error(**kwargs: Any) -> str:
    with pytest.raises(StrategyConfigError) as info:
        HorovodStrategy(**kwargs)
    return str(info.value)


# Conflicts both front ends can be asked for, with the start of the one message they give.
SHARED = [
    (dict(zero_stage=1, compression="int8"),  # the strategy used to accept stage 1 with int8
     "zero_stage=1 with compression='int8': error feedback keeps per-rank residuals of whole gradients"),
    (dict(zero_stage=2, compression="powersgd:2"), "zero_stage=2 with compression='powersgd"),
    (dict(zero_stage=1, compression="auto"),
     "zero_stage=1 with compression='auto': auto may choose PowerSGD"),
    (dict(zero_stage=2, compression="fp16"),
     "zero_stage=2 with compression='fp16': the fp16 global scale is not applied to the reduce-scatter"),
    (dict(zero_stage="2"), "zero_stage must be an int 0, 1 or 2, got the str '2'"),
    (dict(zero_overlap_exchange=True), "zero_overlap_exchange=True needs zero_stage=1 or 2"),
    (dict(compression="powersgd:x"), "compression='powersgd:x': expected 'powersgd' or 'powersgd:R'"),
]


@pytest.mark.parametrize(("kwargs", "start"), SHARED)
def test_torch_optimizer_and_strategy_refuse_a_conflict_with_the_same_message(kwargs: dict,
                                                                              start: str) -> None:
    torch_msg, strategy_msg = _torch_error(**kwargs), _strategy_error(**kwargs)
    assert torch_msg == strategy_msg, (torch_msg, strategy_msg)
    assert torch_msg.startswith(start) and "HINT" in torch_msg, torch_msg


def test_combinations_that_run_are_accepted_by_both() -> None:
    for kwargs in (dict(zero_stage=1, compression="bf16"), dict(zero_stage=2, zero_overlap_exchange=True),
                   dict(compression="powersgd:2"), dict(compression="auto")):
        HorovodStrategy(**kwargs)
        model = torch.nn.Linear(2, 1)
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                 world=_world(), **kwargs)


def test_strategy_refuses_outer_arguments_that_compression_auto_alone_would_ignore() -> None:
    # compression="auto" chooses a wire format, never local steps: outer_lr would change nothing
    assert _strategy_error(outer_lr=0.5, compression="auto").startswith(
        "outer_lr=0.5 set without sync_every: the outer loop runs only with local steps")
    strategy = HorovodStrategy(outer_lr=0.5, sync_every="auto")  # auto may choose local steps
    assert strategy.local_steps is None and strategy._opts.asked == {"compression": False, "sync_every": True}
    assert strategy._opts.local_for(8).outer_lr == 0.5


def test_strategy_refuses_compression_auto_with_a_fixed_period() -> None:
    # auto's choice (a gradient wire format) would be announced and never used by the outer loop
    message = _strategy_error(compression="auto", sync_every=4)
    assert message.startswith("compression='auto' with sync_every=4: auto chooses the gradients' wire format")
    assert "HINT: sync_every='auto' too" in message
    HorovodStrategy(compression="auto", sync_every="auto")  # both chosen: runs


def test_torch_adasum_refuses_auto_and_error_feedback() -> None:
    assert _torch_error(op=hvd.Adasum, compression="auto").startswith(
        "compression='auto' with op=Adasum: Adasum combines whole vectors")
    assert _torch_error(op=hvd.Adasum, compression="int8").startswith("compression='int8' with op=Adasum")
    assert _torch_error(op=hvd.Adasum, zero_stage=1).startswith("zero_stage=1 with op=Adasum")


def test_an_unknown_op_is_the_front_ends_error() -> None:
    message = _torch_error(op="median")
    assert message.startswith("op='median': unknown reduce op 'median'") and "HINT: op=Average" in message


def test_outer_loop_messages_name_the_front_ends_arguments() -> None:
    names = {"fragments": "outer_fragments", "overlap_steps": "outer_overlap_steps"}
    with pytest.raises(FrontEndError) as info:
        SyncOptions.check(error=FrontEndError, sync_every=4, outer=OuterArgs(overlap_steps=4), names=names)
    assert str(info.value).startswith("outer_overlap_steps=4 must be an int in [0, sync_every=4)")
    assert "HINT: outer_overlap_steps=sync_every // 4" in str(info.value)
    with pytest.raises(FrontEndError, match=r"^outer_fragments=2 with sync_every='auto'"):
        SyncOptions.check(error=FrontEndError, sync_every="auto", outer=OuterArgs(fragments=2), names=names)
    with pytest.raises(LocalSGDConfigError, match=r"^fragments=3 must be an int >= 1 that divides"):
        local_steps_config(4, OuterArgs(fragments=3), None, error=LocalSGDConfigError)


def test_local_steps_config_checks_auto_with_a_placeholder_period() -> None:
    config, auto = local_steps_config("auto", OuterArgs(overlap_steps=3), "bf16", error=FrontEndError)
    assert auto and config is not None and config.sync_every == 4 and config.compression.name == "bf16"
    assert local_steps_config(None, OuterArgs(), None, error=FrontEndError) == (None, False)
    config, auto = local_steps_config(8, OuterArgs(), None, error=FrontEndError)
    assert not auto and config == LocalSGDConfig(sync_every=8)


def test_zero_stage2_with_accumulation_is_refused_only_where_the_front_end_cannot_run_it() -> None:
    SyncOptions.check(error=FrontEndError, zero_stage=2, backward_passes_per_step=2)  # torch, Lightning
    with pytest.raises(FrontEndError, match=r"^zero_stage=2 with backward_passes_per_step=2"):
        SyncOptions.check(error=FrontEndError, zero_stage=2, backward_passes_per_step=2,
                          zero2_with_accumulation=False)  # Keras


def _keras_callback_defaults() -> dict[str, Any]:
    """The literal defaults of ``LocalSGDCallback.__init__``, read from its source (importing Keras
    here would fix this process's Keras backend)."""
    tree = ast.parse((ROOT / "hvd_trainer/keras/callbacks/local_sgd.py").read_text())
    init = next(n for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "LocalSGDCallback"
                for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args
    pairs = list(zip(args.args[len(args.args) - len(args.defaults):], args.defaults, strict=True))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
    return {a.arg: ast.literal_eval(d) for a, d in pairs if isinstance(d, ast.Constant)}


def _signature_defaults(cls: type) -> dict[str, Any]:
    return {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items()}


@pytest.mark.parametrize("front_end", ["strategy", "torch", "keras"])
def test_every_front_ends_outer_defaults_are_the_librarys(front_end: str) -> None:
    from hvd_trainer.torch.local_sgd import LocalSGD

    defaults = {"strategy": lambda: _signature_defaults(HorovodStrategy),
                "torch": lambda: _signature_defaults(LocalSGD),
                "keras": _keras_callback_defaults}[front_end]()
    prefix = "outer_" if front_end == "strategy" else ""
    for name, value in OuterArgs().__dict__.items():
        spelled = name if name in ("outer_lr", "outer_momentum", "sync_warmup_steps") else prefix + name
        assert defaults[spelled] == value, (front_end, spelled, defaults.get(spelled), value)

"""The recipes' slow-link keys (trainer.sync_every, outer_lr, outer_momentum, compression) build
the configured HorovodStrategy; the defaults keep strategy="horovod" as a plain name."""

from __future__ import annotations

from pathlib import Path

import pytest

from hvd_trainer.launch.train_cli import load_config
from recipes import digits, gpt
from recipes._strategy import build_strategy


def test_defaults_keep_the_strategy_name() -> None:
    assert build_strategy(gpt.TrainerConfig()) == "horovod"
    assert build_strategy(digits.TrainerConfig()) == "horovod"


@pytest.mark.parametrize("module", [gpt, digits])
def test_sync_every_and_compression_build_the_strategy(module) -> None:
    from hvd_trainer.strategy import HorovodStrategy

    cfg = module.TrainerConfig(sync_every=16, outer_lr=0.5, outer_momentum=0.8, compression="bf16",
                               outer_overlap_steps=3, outer_fragments=4)
    strategy = build_strategy(cfg)
    assert isinstance(strategy, HorovodStrategy)
    local = strategy.local_steps
    assert (local.sync_every, local.outer_lr, local.outer_momentum, local.nesterov, local.overlap_steps,
            local.fragments) == (16, 0.5, 0.8, True, 3, 4)
    assert local.compression.name == "bf16"
    assert local.sync_warmup_steps == 128  # the key's -1: the library's default
    off = build_strategy(module.TrainerConfig(sync_every=16, sync_warmup_steps=0))
    assert off.local_steps.sync_warmup_steps == 0
    assert build_strategy(module.TrainerConfig(compression="fp16")).local_steps is None
    with pytest.raises(ValueError, match=r"trainer.outer_lr=0.5 set without trainer.sync_every.*HINT"):
        module.TrainerConfig(outer_lr=0.5)  # trainer.outer_lr=0.5 alone would change nothing
    with pytest.raises(ValueError, match=r"trainer.outer_fragments=4 set without trainer.sync_every"):
        module.TrainerConfig(outer_fragments=4)
    with pytest.raises(ValueError, match=r"trainer.outer_lr=0.5 set without trainer.sync_every"):
        module.TrainerConfig(outer_lr=0.5, compression="auto")  # compression=auto alone: no local steps
    assert module.TrainerConfig(outer_lr=0.5, sync_every="auto", compression="auto").outer_lr == 0.5
    with pytest.raises(ValueError, match=r"trainer.compression=auto with trainer.sync_every=16.*HINT"):
        module.TrainerConfig(sync_every=16, compression="auto")


def test_invalid_keys_raise() -> None:
    with pytest.raises(ValueError, match="sync_every=-1"):
        gpt.TrainerConfig(sync_every=-1)
    with pytest.raises(ValueError, match="strategy=horovod"):
        gpt.TrainerConfig(strategy="ddp", sync_every=4)
    with pytest.raises(ValueError, match=r"trainer.sync_warmup_steps=-5 must be .* HINT"):
        gpt.TrainerConfig(sync_every=4, sync_warmup_steps=-5)  # checked with the config, not at fit
    assert gpt.TrainerConfig(sync_every=4, sync_warmup_steps=-1).sync_warmup_steps == -1  # the default


def test_zero_stage_errors_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"^trainer.zero_stage=5 must be 0, 1 or 2.$"):
        gpt.TrainerConfig(zero_stage=5)
    with pytest.raises(ValueError, match=r"needs trainer.strategy=horovod \(got trainer.strategy=ddp\)"):
        gpt.TrainerConfig(zero_stage=1, strategy="ddp")


def test_the_command_line_reaches_the_keys() -> None:
    yaml = Path(__file__).resolve().parents[2] / "conf" / "gpt.yaml"
    cfg = load_config(gpt.Config, yaml, ["trainer.sync_every=32", "trainer.compression=bf16"])
    assert cfg.trainer.sync_every == 32 and cfg.trainer.compression == "bf16"


def test_sync_every_auto_from_the_command_line() -> None:
    yaml = Path(__file__).resolve().parents[2] / "conf" / "gpt.yaml"
    cfg = load_config(gpt.Config, yaml, ["trainer.sync_every=auto", "trainer.compression=auto"])
    assert cfg.trainer.sync_every == "auto"
    strategy = build_strategy(cfg.trainer)
    assert strategy._opts.asked == {"compression": True, "sync_every": True}
    assert strategy.local_steps is None  # decided at the start of fit, from the measured link


@pytest.mark.parametrize("bad", ["sometimes", -2, 2.5])
def test_sync_every_must_be_an_int_or_auto(bad) -> None:
    with pytest.raises(ValueError, match="an int >= 0 .* or auto"):
        gpt.TrainerConfig(sync_every=bad)

"""hvd-train's config merge: dataclass defaults < conf/<recipe>.yaml < command-line dotlist."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import pytest

from hvd_trainer.launch import train_cli
from hvd_trainer.launch.train_cli import CONF_DIR, ConfigError, format_result, load_config, main
from recipes.digits import Config


def test_defaults_then_yaml_then_dotlist(tmp_path: Path) -> None:
    yaml = tmp_path / "digits.yaml"
    yaml.write_text("trainer:\n  max_epochs: 7\noptim:\n  lr: 0.2\n")
    cfg = load_config(Config, yaml, ["optim.lr=0.01", "data.batch_size_per_rank=16"])
    assert isinstance(cfg, Config)
    assert cfg.trainer.max_epochs == 7  # from the YAML
    assert cfg.optim.lr == 0.01  # the command line wins over the YAML
    assert cfg.data.batch_size_per_rank == 16
    assert cfg.optim.momentum == 0.9  # untouched default
    assert cfg.trainer.strategy == "horovod"


def test_shipped_yaml_is_valid() -> None:
    cfg = load_config(Config, CONF_DIR / "digits.yaml", [])
    assert cfg.trainer.max_epochs == 20 and cfg.trainer.strategy == "horovod"


def test_unknown_key_is_named_with_valid_keys() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(Config, None, ["optim.learning_rate=0.1"])
    msg = str(info.value)
    assert "learning_rate" in msg
    for key in ("optim.lr", "trainer.max_epochs", "data.batch_size_per_rank", "model.hidden"):
        assert key in msg
    assert "did you mean" not in msg  # nothing close to 'optim.learning_rate'


def test_unknown_key_near_a_valid_one_gets_a_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(Config, None, ["trainer.max_epoch=3"])
    assert "unknown config key 'trainer.max_epoch' (did you mean 'trainer.max_epochs'?)" in str(info.value)


def test_wrong_type_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(Config, None, ["trainer.max_epochs=many"])
    assert "many" in str(info.value)
    assert "'trainer.max_epochs'" in str(info.value)  # the key is named


def test_schema_validation_runs() -> None:
    with pytest.raises(ConfigError, match="max_epochs"):
        load_config(Config, None, ["trainer.max_epochs=0"])


def test_main_reports_config_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe=digits", "optim.nope=1"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["recipe=no_such_recipe"]) == 2
    assert "digits" in capsys.readouterr().err
    assert main(["recipe=digits", "optim.lr=-1"]) == 2  # a range error: a message, not a traceback
    assert "optim.lr=-1.0 must be > 0" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "recipe=NAME" in capsys.readouterr().out


def test_result_line_format() -> None:
    line = format_result(
        {"world_size": 2, "val_acc": 0.9712, "epochs": 20, "samples_per_s": 1234.56, "wall_s": 42.04}
    )
    assert line == "RESULT world_size=2 val_acc=0.97 epochs=20 samples_per_s=1234.6 wall_s=42.0"


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_JOB_NAME")


@pytest.mark.parametrize(
    ("env", "prints"),
    [
        ({}, True),
        ({"RANK": "0", "WORLD_SIZE": "2"}, True),
        ({"RANK": "1", "WORLD_SIZE": "2"}, False),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, True),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, False),
        ({"PMI_RANK": "1", "PMI_SIZE": "2"}, False),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, True),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, False),
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, False),  # Lightning's self-launch, local rank 1
    ],
)
def test_result_line_on_global_rank_0_only_under_every_launcher(
    env: dict[str, str], prints: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    @dataclasses.dataclass
    class FakeConfig:
        steps: int = 1

    module_name = f"{train_cli._recipe_package()}.fake_result"  # hvd_trainer.recipes once installed
    recipe = types.ModuleType(module_name)
    recipe.Config = FakeConfig
    recipe.run = lambda cfg: {"world_size": 2, "val_acc": 0.5, "epochs": cfg.steps,
                              "samples_per_s": 1.0, "wall_s": 2.0}
    monkeypatch.setitem(sys.modules, module_name, recipe)
    assert main(["recipe=fake_result", "steps=3"]) == 0
    out = capsys.readouterr().out
    assert ("RESULT world_size=2 val_acc=0.50 epochs=3" in out) is prints, (env, out)

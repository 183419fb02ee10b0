"""``hvd-train --help``, ``hvd-train recipe=NAME --help`` and ``--print-config`` (in process)."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
from omegaconf import OmegaConf

from hvd_trainer.launch import train_cli
from hvd_trainer.launch.config_help import field_docs, list_recipes
from hvd_trainer.launch.train_cli import CONF_DIR, format_result, load_config, main


def _gpt():
    return train_cli._import_recipe("gpt")


def test_help_lists_the_recipes_with_their_summaries(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "recipe=NAME" in out and "--print-config" in out
    recipes = dict(list_recipes(list(importlib.import_module(train_cli._recipe_package()).__path__)))
    assert {"digits", "digits_keras", "gpt", "gpt_gpu"} <= set(recipes)
    assert not any(name.startswith("_") for name in recipes)  # helpers such as _gpt_data are hidden
    for name in ("digits", "digits_keras", "gpt", "gpt_gpu"):
        assert any(line.split()[:1] == [name] for line in out.splitlines()), out
    assert "byte-level GPT on Shakespeare" in out


def test_recipe_help_shows_every_key_with_type_value_default_and_doc(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gpt = _gpt()
    assert main(["recipe=gpt", "--help"]) == 0
    out = capsys.readouterr().out
    keys = train_cli._valid_keys(gpt.Config())
    assert len(keys) > 20
    lines = out.splitlines()
    for key in keys:
        (row,) = [i for i, line in enumerate(lines) if line.startswith(f"  {key}: ")]
        assert lines[row + 1].startswith("      ") and len(lines[row + 1].strip()) > 5, (key, out)
    assert "  model.n_layer: int = 3" in out  # the value after conf/gpt.yaml...
    assert ("  trainer.log_every_n_steps: int = 100  (from gpt.yaml or the command line; schema "
            "default 25)\n      Log train loss and learning rate (and print a progress line) every "
            "this many steps.") in out
    assert "  trainer.max_steps: int = 1500  (from gpt.yaml" in out
    assert "      Context length in bytes." in out  # ...and the field's docstring
    assert "  trainer.strategy: str = 'horovod'" in out and "  optim.lr: float = 0.003" in out


def test_recipe_help_shows_command_line_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe=gpt", "model.n_layer=7", "--help"]) == 0
    assert "  model.n_layer: int = 7  (from gpt.yaml or the command line; schema default 3)" in (
        capsys.readouterr().out
    )


def test_print_config_prints_the_merged_config_and_does_not_train(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gpt = _gpt()
    monkeypatch.setattr(gpt, "run", lambda cfg: pytest.fail("--print-config must not train"))
    assert main(["recipe=gpt", "--print-config", "optim.lr=0.01", "data.batch_size_per_rank=4"]) == 0
    printed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(gpt.Config),
                                                  OmegaConf.create(capsys.readouterr().out)))
    expected = load_config(gpt.Config, CONF_DIR / "gpt.yaml", ["optim.lr=0.01", "data.batch_size_per_rank=4"])
    assert printed == expected
    assert printed.optim.lr == 0.01 and printed.model.n_embd == 96


def test_help_and_print_config_report_config_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe=gpt", "--print-config", "model.n_embd=98"]) == 2  # not a multiple of n_head
    assert "model.n_embd=98 must be a multiple of model.n_head=4" in capsys.readouterr().err
    assert main(["recipe=nope", "--help"]) == 2
    assert "gpt" in capsys.readouterr().err


def test_field_docs_reads_the_docstring_under_each_field() -> None:
    gpt = _gpt()
    docs = field_docs(gpt.ModelConfig)
    assert docs["block_size"] == "Context length in bytes."
    assert set(docs) == {f.name for f in dataclasses.fields(gpt.ModelConfig)}

    @dataclasses.dataclass
    class NoDocs:
        a: int = 1

    assert field_docs(NoDocs) == {}


def test_result_line_carries_only_the_fields_the_recipe_returned() -> None:
    # a language model: no accuracy, epochs or samples per second
    line = format_result({"world_size": 2, "wall_s": 78.1, "val_loss": 2.40811, "unigram_loss": 3.32217,
                          "tokens_per_s": 16709.14, "steps": 500})
    assert line == ("RESULT world_size=2 wall_s=78.1 val_loss=2.4081 unigram_loss=3.3222 "
                    "tokens_per_s=16709.1 steps=500")
    # known fields in their order whatever the dict's, then a recipe's own fields as returned
    line = format_result({"mfu": 0.125, "steps": 3, "wall_s": 1.0, "world_size": 1, "note": "x"})
    assert line == "RESULT world_size=1 wall_s=1.0 steps=3 mfu=0.125 note=x"
    with pytest.raises(ValueError, match=r"lacks \['wall_s'\]"):
        format_result({"world_size": 1, "val_loss": 2.0})


def test_unknown_or_helper_recipe_names_list_only_recipes() -> None:
    for name in ("nope", "_gpt_data"):
        with pytest.raises(train_cli.ConfigError) as info:
            train_cli._import_recipe(name)
        message = str(info.value)
        said, _, available = message.partition("available:")
        assert f"no recipe {name!r}" in said and "'gpt'" in available and "_gpt" not in available


def test_recipes_come_from_the_checkout_of_this_hvd_trainer() -> None:
    # a worktree on PYTHONPATH next to an editable install of another checkout (which maps
    # hvd_trainer.recipes to that checkout's recipes/) runs its own recipes
    from pathlib import Path

    root = Path(train_cli.__file__).resolve().parents[2]
    assert Path(train_cli._import_recipe("gpt").__file__).resolve() == root / "recipes" / "gpt.py"

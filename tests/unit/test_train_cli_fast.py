"""hvd-train reads and checks the config without importing the recipe (nor Lightning, Keras), and
only global rank 0 prints a config error, ``--help`` or ``--print-config``; every rank exits with
the same status. The subprocesses start as a launcher starts hvd-train: a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_trainer.comm.base import launch_env
from hvd_trainer.launch import train_cli
from hvd_trainer.launch.config_help import schema_module
from hvd_trainer.launch.train_cli import main

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_JOB_NAME", "HOROVOD_RANK", "HOROVOD_SIZE", "TORCHELASTIC_RUN_ID")
FRAMEWORKS = ("pytorch_lightning", "lightning", "lightning_fabric", "keras", "tensorflow", "torchmetrics")
"""What a recipe imports and a config error must not: the recipe's own frameworks."""
RECIPES = ("gpt", "gpt_gpu", "digits", "digits_keras")

PROBE = r"""
import contextlib, io, json, sys
from hvd_trainer.launch import train_cli
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = train_cli.main(argv)
    results.append({"rc": rc, "out": out.getvalue(), "err": err.getvalue()})
roots = json.loads(sys.argv[2])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in roots or ".recipes." in f".{m}.")
print(json.dumps({"results": results, "loaded": loaded}))
"""
"""Runs ``main`` on each argv of ``argv[1]`` (JSON) in one fresh interpreter; prints the statuses,
outputs and the modules of ``argv[2]``'s packages (and recipe modules) then loaded."""


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"timed out: {cmd}\n{exc.stdout}\n{exc.stderr}")


@pytest.fixture(scope="module")
def probe() -> dict:
    """Every recipe's config error, then ``--print-config`` and ``--help`` of gpt, in one process."""
    argvs = [[f"recipe={name}", "optim.nonexistent_key=1"] for name in RECIPES]  # all have optim
    argvs += [["recipe=gpt", "--print-config"], ["recipe=gpt", "--help"], ["--help"]]
    proc = _run([sys.executable, "-c", PROBE, json.dumps(argvs), json.dumps(["torch", *FRAMEWORKS])],
                _clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    report["argvs"] = argvs
    return report


def test_a_config_error_names_the_key_with_a_hint(probe: dict) -> None:
    for argv, result in zip(probe["argvs"][:len(RECIPES)], probe["results"][:len(RECIPES)], strict=True):
        name = argv[0].removeprefix("recipe=")
        assert result["rc"] == 2 and result["out"] == "", (argv, result)
        error = "hvd-train: error: unknown config key 'optim.nonexistent_key'"
        assert result["err"].startswith(error), result
        assert f"\nHINT: hvd-train recipe={name} --help lists every key" in result["err"], result


def test_config_errors_help_and_print_config_import_no_recipe_and_no_framework(probe: dict) -> None:
    assert [r["rc"] for r in probe["results"][len(RECIPES):]] == [0, 0, 0]
    assert "\nmodel:\n  block_size: 128\n" in probe["results"][len(RECIPES)]["out"]  # --print-config
    # The schemas (recipes._gpt_config, ...) were read, not the recipes that import Lightning
    # (digits_keras imports Keras in run() only, so it is its own schema).
    recipes = [m for m in probe["loaded"] if ".recipes." in f".{m}."]
    assert any(m.endswith("._gpt_config") for m in recipes), recipes
    assert not [m for m in recipes if m.rsplit(".", 1)[-1] in ("gpt", "gpt_gpu", "digits")], recipes
    frameworks = [m for m in probe["loaded"] if m.split(".")[0] in FRAMEWORKS]
    assert not frameworks, frameworks[:10]


def test_config_errors_help_and_print_config_import_no_torch(probe: dict) -> None:
    assert "torch" not in probe["loaded"]


@pytest.mark.parametrize(("env", "printed"), [({}, True), ({"RANK": "0", "WORLD_SIZE": "2"}, True),
                                              ({"RANK": "1", "WORLD_SIZE": "2"}, False)])
def test_only_global_rank_0_prints_the_error_and_every_rank_exits_2(env: dict[str, str],
                                                                   printed: bool) -> None:
    cmd = [sys.executable, "-m", "hvd_trainer.launch.train_cli", "recipe=gpt", "trainer.nonexistent_key=1"]
    proc = _run(cmd, _clean_env(**env))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    if printed:
        assert "unknown config key 'trainer.nonexistent_key'" in proc.stderr and "HINT:" in proc.stderr
    else:
        assert proc.stderr == ""


@pytest.mark.parametrize("env", [
    {"RANK": "1", "WORLD_SIZE": "2"},
    {"LOCAL_RANK": "1", "WORLD_SIZE": "2"},  # Lightning's self-launch
    {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"},
    {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
    {"PMI_RANK": "1", "PMI_SIZE": "2"},
    {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"},
])
@pytest.mark.parametrize(("argv", "status"), [
    (["recipe=gpt", "trainer.nonexistent_key=1"], 2),
    (["recipe=nope"], 2),
    (["recipe=gpt", "--print-config"], 0),
    (["recipe=gpt", "--help"], 0),
    (["--help"], 0),
])
def test_other_ranks_print_nothing_and_return_rank_0s_status(
    env: dict[str, str], argv: list[str], status: int, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    assert main(argv) == status
    alone = capsys.readouterr()
    assert alone.out + alone.err != ""  # no launcher: this is rank 0, which prints
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == status
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", ""), (env, argv)


def test_the_launch_env_loaded_from_its_file_is_launcher_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # What train_cli uses where hvd_trainer.comm (and torch) is not imported.
    monkeypatch.delitem(sys.modules, "hvd_trainer.comm.base.launch_env")
    try:
        alone = train_cli._launch_env()
        assert alone is not launch_env and Path(alone.__file__) == Path(launch_env.__file__).resolve()
        for env in ({}, {"RANK": "3", "WORLD_SIZE": "4"}, {"OMPI_COMM_WORLD_RANK": "2"},
                    {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, {"LOCAL_RANK": "1", "WORLD_SIZE": "2"}):
            assert alone.launcher_rank(env) == launch_env.launcher_rank(env), env
    finally:
        sys.modules.pop("_hvd_train_launch_env", None)


def test_schema_module_follows_the_recipes_config_imports(tmp_path: Path) -> None:
    paths = [str(ROOT / "recipes")]
    found = {name: schema_module(paths, name) for name in (*RECIPES, "nope")}
    assert found == {"gpt": "_gpt_config", "gpt_gpu": "_gpt_config", "digits": "_digits_config",
                     "digits_keras": "digits_keras", "nope": None}
    (tmp_path / "a.py").write_text("from .b import Config\n")
    (tmp_path / "b.py").write_text("from .a import Config\n")  # a cycle
    (tmp_path / "c.py").write_text("from .d import Config as Schema\nConfig = Schema\n")  # not said
    (tmp_path / "e.py").write_text("from .c import run\n\n\nclass Config:\n    pass\n")
    assert [schema_module([str(tmp_path)], n) for n in "abce"] == [None, None, None, "e"]


def test_the_schema_is_the_class_the_recipe_runs_with() -> None:
    for name in RECIPES:
        assert train_cli._recipe_schema(name) is train_cli._import_recipe(name).Config, name

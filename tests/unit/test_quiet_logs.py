"""Lightning's litlogger tip under hvdrun (hvd_trainer/lightning/quiet.py): a real Trainer in a
fresh interpreter, its real stderr."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.interpreters import run_at_once

ROOT = Path(__file__).resolve().parents[2]
TIP = "try installing [litlogger]"
CODE = (
    "import hvd_trainer, pytorch_lightning as pl\n"
    "pl.Trainer(accelerator='cpu', devices=1, logger=False, enable_progress_bar=False)\n"
)
LAUNCHER_VARS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HVD_TRAINER_VERBOSE", "HOROVOD_LOG_LEVEL", "RANK",
                 "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")


SRUN = "The `srun` command is available on your system but is not used"


LITLOGGER_CASES = [
    ({}, True),  # not launched by hvdrun: Lightning as it is
    ({"HOROVOD_RANK": "0"}, False),
    ({"HOROVOD_RANK": "0", "HVD_TRAINER_VERBOSE": "1"}, True),  # hvdrun --verbose
    ({"HOROVOD_RANK": "0", "HOROVOD_LOG_LEVEL": "debug"}, True),
]


def _env(path_dir: Path, **env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    base["PYTHONPATH"] = str(ROOT)
    # an `srun` on PATH (a stand-in, never run): Lightning's SLURM check then warns
    base["PATH"] = os.pathsep.join([str(path_dir), base.get("PATH", "")])
    return {**base, **env}


@pytest.fixture(scope="module")
def litlogger_runs(tmp_path_factory: pytest.TempPathFactory) -> list[subprocess.CompletedProcess]:
    """A fresh interpreter per case, all started at once (each spends seconds importing Lightning)."""
    path_dir = tmp_path_factory.mktemp("srun")
    srun = path_dir / "srun"
    srun.write_text("#!/bin/sh\nexit 1\n")
    srun.chmod(0o755)
    envs = [_env(path_dir, **env) for env, _ in LITLOGGER_CASES]
    return run_at_once([CODE] * len(envs), envs=envs, cwd=str(ROOT), timeout_seconds=120)


@pytest.mark.parametrize("case", range(len(LITLOGGER_CASES)),
                         ids=[f"env{i}-{shown}" for i, (_, shown) in enumerate(LITLOGGER_CASES)])
def test_litlogger_tip_only_outside_hvdrun_or_when_verbose(
        case: int, litlogger_runs: list[subprocess.CompletedProcess]) -> None:
    shown = LITLOGGER_CASES[case][1]
    run = litlogger_runs[case]
    assert run.returncode == 0, run.stderr
    out = run.stdout + run.stderr
    assert (TIP in out) is shown, out
    assert (SRUN in out) is shown, out  # the SLURM hint goes with it
    assert "GPU available:" in out, out  # Lightning's other lines are kept


def test_hvdrun_verbose_exports_the_switch() -> None:
    from hvd_trainer.launch.commands import worker_env
    from hvd_trainer.launch.options import parse_options

    verbose, _ = parse_options(["-np", "2", "--verbose", "python", "x.py"])
    plain, _ = parse_options(["-np", "2", "python", "x.py"])
    assert verbose is not None and plain is not None
    assert worker_env(verbose).get("HVD_TRAINER_VERBOSE") == "1"
    assert "HVD_TRAINER_VERBOSE" not in worker_env(plain)

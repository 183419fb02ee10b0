"""Horovod's example scripts, as a Horovod user runs them: ``hvdrun -np 2`` and only the import
line changed (data: the MNIST-shaped stand-in in tests/e2e/examples/standin.py).

Each script under tests/e2e/examples/ does what one Horovod example does, with the same ``hvd``
calls, written for these tests; each rank reports its results as JSON (rank outputs may mix on
stdout) and the test asserts them: the loss falls, both ranks end with identical weights, and the
example's own summary line is printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.e2e.hvdrun_helpers import clean_env, hvdrun

EXAMPLES = Path(__file__).resolve().parent / "examples"


def _run(script: str, tmp_path: Path, *flags: str, **env: str) -> tuple[list[dict[str, Any]], str]:
    res = hvdrun(["-np", "2", *flags, "python", str(EXAMPLES / f"{script}.py")], timeout=150,
                 env=clean_env(EXAMPLE_OUT=str(tmp_path), **env))
    assert res.returncode == 0, res.explain()
    reports = []
    for rank in (0, 1):
        path = tmp_path / f"{script}.{rank}.json"
        assert path.exists(), f"rank {rank} wrote no report\n{res.explain()}"
        reports.append(json.loads(path.read_text()))
    return reports, res.output


def _same_weights(r0: dict[str, Any], r1: dict[str, Any]) -> None:
    np.testing.assert_array_equal(np.asarray(r0["weights"]), np.asarray(r1["weights"]))


def _falls(losses: list[float], k: int = 4) -> bool:
    return float(np.mean(losses[-k:])) < 0.7 * float(np.mean(losses[:k]))


def test_pytorch_mnist(tmp_path: Path) -> None:
    (r0, r1), output = _run("torch_mnist", tmp_path)
    assert "Test set: Average loss:" in output and "Train Epoch: 2" in output
    _same_weights(r0, r1)
    for res in (r0, r1):
        assert len(res["losses"]) == 2 * 16 and _falls(res["losses"])
    # the metrics were averaged with hvd.allreduce: equal on both ranks, well above chance (0.1)
    assert r0["accuracy"] == r1["accuracy"] > 0.3
    assert r0["test_loss"] == r1["test_loss"]


def test_pytorch_synthetic_benchmark(tmp_path: Path) -> None:
    (r0, r1), output = _run("torch_synthetic_benchmark", tmp_path)
    assert "Total img/sec on 2 CPU(s):" in output
    _same_weights(r0, r1)
    assert r0["total"] == r1["total"]
    assert r0["total"] == pytest.approx(r0["mean"] + r1["mean"], rel=1e-5)


def test_pytorch_lightning_mnist(tmp_path: Path) -> None:
    (r0, r1), _ = _run("lightning_mnist", tmp_path)
    _same_weights(r0, r1)
    for res in (r0, r1):
        assert res["strategy"] == "HorovodStrategy" and res["world_size"] == 2
        assert res["epochs"] == 3 and res["train_end"] is True
        v = res["val_loss"]
        assert len(v) == 3 and v[0] > v[1] > v[2] and v[2] < 0.9 * v[0]
    assert r0["val_loss"] == r1["val_loss"] and r0["accuracy"] == r1["accuracy"]


def test_tensorflow2_keras_mnist(tmp_path: Path) -> None:
    (r0, r1), output = _run("keras_mnist", tmp_path, KERAS_BACKEND="torch")
    assert "finished learning-rate warmup" in output
    _same_weights(r0, r1)
    for res in (r0, r1):
        assert len(res["loss"]) == 3 and res["loss"][-1] < 0.7 * res["loss"][0]
    assert r0["loss"] == pytest.approx(r1["loss"], rel=1e-6)  # MetricAverageCallback
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*.weights.h5")) == [
        f"checkpoint-{e}.weights.h5" for e in (1, 2, 3)]


@pytest.mark.parametrize("flags", [(), ("--min-np", "2", "--max-np", "2", "--max-restarts", "1")],
                         ids=["plain", "elastic_flags"])
def test_pytorch_mnist_elastic(tmp_path: Path, flags: tuple[str, ...]) -> None:
    (r0, r1), _ = _run("torch_elastic", tmp_path, *flags)
    _same_weights(r0, r1)
    for res in (r0, r1):
        # 256 samples / 2 ranks / batch 16 = 8 batches per epoch, committed at batches 0 and 4
        assert res["epoch"] == 2 and res["commits"] == 4
        assert len(res["losses"]) == 16 and _falls(res["losses"])


def test_lightning_trainer_without_strategy_under_hvdrun(tmp_path: Path) -> None:
    """A bare ``Trainer()`` in a program that never imports hvd_trainer (hvdrun's workers register
    the strategy when Lightning is imported)."""
    (r0, r1), output = _run("lightning_no_strategy", tmp_path)
    for res in (r0, r1):
        assert res["horovod_size"] == "2"  # hvdrun exports Horovod's variables (issue 11, class 7)
        assert res["strategy"] == "HorovodStrategy" and res["world_size"] == 2
        assert res["hvd_trainer_imported"] is True  # by hvdrun's worker sitecustomize, not the program
    assert r0["weights"] == r1["weights"]  # one model trained, not two independent ones
    assert output.count("using strategy='horovod', as Lightning 1.x did") == 1  # said once, on rank 0


def test_lightning_single_device_strategy_under_hvdrun_is_named(tmp_path: Path) -> None:
    """An explicit single-device strategy trains alone in every process: allowed, said on rank 0."""
    script = str(EXAMPLES / "lightning_no_strategy.py")
    res = hvdrun(["-np", "2", "python", script, "--strategy", "single_device"], timeout=150,
                 env=clean_env(EXAMPLE_OUT=str(tmp_path)))
    assert res.returncode == 0, res.explain()
    r0, r1 = (json.loads((tmp_path / f"lightning_no_strategy.{rank}.json").read_text()) for rank in (0, 1))
    assert r0["strategy"] == r1["strategy"] == "SingleDeviceStrategy"
    assert r0["weights"] != r1["weights"]  # two models indeed (rank-dependent initial weights)
    assert res.output.count("so every process trains its own model") == 1, res.explain()
    assert "HINT: Trainer(strategy='horovod')" in res.output


def test_lightning_cli_program_with_horovod_strategy_from_the_command_line(tmp_path: Path) -> None:
    """``LightningCLI`` with ``--trainer.strategy=horovod``, no hvd_trainer line in the program."""
    script = str(EXAMPLES / "lightning_cli.py")
    res = hvdrun(["-np", "2", "python", script, "fit", "--trainer.strategy=horovod",
                  "--trainer.accelerator=cpu", "--trainer.max_steps=3", "--trainer.logger=false",
                  "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
                  f"--trainer.default_root_dir={tmp_path}"], timeout=150,
                 env=clean_env(EXAMPLE_OUT=str(tmp_path)))
    assert res.returncode == 0, res.explain()
    r0, r1 = (json.loads((tmp_path / f"lightning_cli.{rank}.json").read_text()) for rank in (0, 1))
    for r in (r0, r1):
        assert r["strategy"] == "HorovodStrategy" and r["world_size"] == 2 and r["hvd_trainer_imported"]
    assert r0["weights"] == r1["weights"]
    assert (tmp_path / "config.yaml").exists()  # LightningCLI's SaveConfigCallback ran (rank 0)


def test_lightning_cli_program_under_torchrun_with_the_strategy_class_path(tmp_path: Path) -> None:
    """The same program under plain torchrun (no hvdrun to register ``"horovod"``): the class
    path form of ``--trainer.strategy`` imports the strategy itself."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / "lightning_cli.py"), "fit",
           '--trainer.strategy={"class_path": "hvd_trainer.strategy.HorovodStrategy"}',
           "--trainer.accelerator=cpu", "--trainer.max_steps=3", "--trainer.logger=false",
           "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
           f"--trainer.default_root_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean_env(EXAMPLE_OUT=str(tmp_path)),
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"lightning_cli.{rank}.json").read_text()) for rank in (0, 1))
    for r in (r0, r1):
        assert r["strategy"] == "HorovodStrategy" and r["world_size"] == 2, r
    assert r0["weights"] == r1["weights"]  # one model (the initial weights were rank-dependent)


def test_unmodified_horovod_script_with_as_horovod(tmp_path: Path) -> None:
    """Horovod's pytorch_mnist.py with no line changed (``import horovod``, ``horovod.torch``,
    ``horovod.torch.mpi_ops``, ``horovod.common.exceptions``) under ``hvdrun --as-horovod``."""
    (r0, r1), output = _run("horovod_pytorch_mnist", tmp_path, "--as-horovod")
    _same_weights(r0, r1)
    assert r0["module"] == "hvd_trainer.torch" and r0["avg"] == r1["avg"]
    assert len(r0["losses"]) == 2 * 16 and _falls(r0["losses"])
    # without the flag, a Horovod script fails as it would without Horovod installed
    res = hvdrun(["-np", "2", "python", str(EXAMPLES / "horovod_pytorch_mnist.py")], timeout=120,
                 env=clean_env(EXAMPLE_OUT=str(tmp_path)))
    assert res.returncode != 0 and "No module named 'horovod'" in res.output, res.explain()


def test_unmodified_horovod_script_through_horovod_run(tmp_path: Path) -> None:
    """The same script's ``--num-proc 2`` path (``horovod.run``) in a process that imported
    ``hvd_trainer.horovod_alias`` first (a notebook's way)."""
    script = str(EXAMPLES / "horovod_pytorch_mnist.py")
    code = ("import runpy, sys; import hvd_trainer.horovod_alias; "
            "sys.argv = ['x', '--num-proc', '2', '--epochs', '1']; "
            f"runpy.run_path({script!r}, run_name='__main__')")
    env = clean_env(EXAMPLE_OUT=str(tmp_path))
    env["PYTHONPATH"] += os.pathsep + str(EXAMPLES)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0 and "RANKS [0, 1]" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"horovod_pytorch_mnist.{r}.json").read_text()) for r in (0, 1)]
    _same_weights(*reports)

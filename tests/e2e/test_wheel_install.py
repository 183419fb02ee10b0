"""A non-editable install works: build the wheel, install it into a folder, train from elsewhere.

``pip install .`` must carry the recipes and their YAML files (the repository's ``recipes/`` and
``conf/`` install as ``hvd_trainer.recipes`` and ``hvd_trainer.conf``), and ``hvd-train
recipe=digits`` must then run from any directory, with nothing of the checkout on the path.

The wheel is built from a copy of the checkout (setuptools writes ``build/`` and ``*.egg-info``
next to the sources), whose ``conf/digits.yaml`` is changed, so the training run shows which YAML
file it read. The venv's editable install of the checkout stays in place: its finder comes after
``PYTHONPATH`` in ``sys.meta_path``, and the test checks that the installed copy is what runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
RESULT = re.compile(r"^RESULT world_size=1 val_acc=(\d\.\d\d) epochs=1 samples_per_s=\S+ wall_s=\S+$")
WHEEL_BATCH = 48
"""batch_size_per_rank in the wheel's conf/digits.yaml (the checkout's says 32)."""

WHERE = """
import hvd_trainer, hvd_trainer.launch.train_cli as cli
recipe = cli._import_recipe("digits")
print("FILES", hvd_trainer.__file__, recipe.__file__, cli.CONF_DIR / "digits.yaml")
"""


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float) -> str:
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n{exc.stdout}\n{exc.stderr}")
    out = proc.stdout + proc.stderr
    tail = "\n".join(out.splitlines()[-30:])
    assert proc.returncode == 0, f"command: {' '.join(cmd)}\nexit code: {proc.returncode}\n{tail}"
    return proc.stdout


def _copy_checkout(dest: Path) -> None:
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("hvd_trainer", "recipes", "conf"):
        shutil.copytree(ROOT / name, dest / name, ignore=skip)
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    yaml = dest / "conf" / "digits.yaml"
    text = yaml.read_text()
    assert "batch_size_per_rank: 32" in text, "conf/digits.yaml changed; update this test"
    yaml.write_text(text.replace("batch_size_per_rank: 32", f"batch_size_per_rank: {WHEEL_BATCH}"))


def _expected_files(src: Path) -> set[str]:
    """Every source file at the path it must have inside the wheel."""
    files = {p.relative_to(src).as_posix() for p in (src / "hvd_trainer").rglob("*.py")}
    files |= {f"hvd_trainer/recipes/{p.name}" for p in (src / "recipes").glob("*.py")}
    files |= {f"hvd_trainer/conf/{p.name}" for p in (src / "conf").glob("*.yaml")}
    return files


def test_wheel_installs_and_trains_from_another_directory(tmp_path: Path) -> None:
    src, wheels, site, elsewhere = (tmp_path / d for d in ("src", "wheels", "site", "elsewhere"))
    _copy_checkout(src)
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), "."], cwd=src, timeout=180)
    (wheel,) = wheels.glob("hvd_trainer-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    missing = sorted(_expected_files(src) - names)
    assert not missing, f"source files missing from {wheel.name} (list new packages in setup.cfg): {missing}"
    top = {n.split("/", 1)[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"hvd_trainer"}, sorted(top)

    _run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], cwd=elsewhere, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1")

    where = _run([sys.executable, "-c", WHERE], cwd=elsewhere, env=env, timeout=120)
    (line,) = [ln for ln in where.splitlines() if ln.startswith("FILES ")]
    for path in line.split()[1:]:
        assert Path(path).is_file(), line
        assert Path(path).resolve().is_relative_to(site.resolve()), f"not the installed copy: {line}"

    out = _run([str(site / "bin" / "hvd-train"), "recipe=digits", "trainer.max_epochs=1"],
               cwd=elsewhere, env=env, timeout=180)
    assert f"batch_size_per_rank={WHEEL_BATCH} " in out, f"the wheel's conf/digits.yaml was not read:\n{out}"
    results = [m for m in map(RESULT.match, out.splitlines()) if m]
    assert len(results) == 1, f"expected one RESULT line:\n{out}"
    assert 0.0 <= float(results[0][1]) <= 1.0, out

    # The GPT recipe from the wheel: its helper modules, conf/gpt.yaml and (for --help) its source.
    out = _run([str(site / "bin" / "hvd-train"), "recipe=gpt", "--help"], cwd=elsewhere, env=env, timeout=180)
    assert "  model.n_layer: int = 3" in out and "      Context length in bytes." in out, out
    out = _run([str(site / "bin" / "hvd-train"), "recipe=gpt", "trainer.max_steps=3", "log.enabled=false",
                "sample.new_tokens=4", "data.val_windows=4"], cwd=elsewhere, env=env, timeout=180)
    assert re.search(r"(?m)^RESULT world_size=1 .* unigram_loss=3\.3222 .* steps=3$", out), out

"""``hvd_trainer.horovod_alias`` and hvdrun's ``--as-horovod`` shim, each case in a fresh Python
process (the alias changes ``sys.meta_path`` and ``sys.modules``).

A stand-in "real Horovod" (a ``horovod`` package in a temporary folder on ``PYTHONPATH``)
checks that the alias never shadows an installed Horovod unless forced.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_trainer.launch.commands import HOROVOD_SHIM_DIR, worker_env
from hvd_trainer.launch.options import parse_options

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, *paths: str, **env: str) -> str:
    pythonpath = os.pathsep.join([*paths, str(ROOT)])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": pythonpath, **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _fake_horovod(tmp_path: Path) -> str:
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text("REAL = True\n")
    (tmp_path / "horovod" / "torch.py").write_text("REAL_TORCH = True\n")
    return str(tmp_path)


MAPPING = """
import hvd_trainer.horovod_alias
import horovod, horovod.torch as hvd, horovod.torch.elastic, horovod.torch.mpi_ops
import horovod.torch.sync_batch_norm as sbn
import hvd_trainer, hvd_trainer.torch, hvd_trainer.torch.elastic, hvd_trainer.torch.sync_batchnorm
from horovod.common.exceptions import HorovodInternalError
assert hvd is hvd_trainer.torch and hvd.__name__ == "hvd_trainer.torch"
assert horovod.torch.elastic is hvd_trainer.torch.elastic is hvd.elastic
assert horovod.torch.mpi_ops is hvd_trainer.torch.mpi_ops
assert sbn is hvd_trainer.torch.sync_batchnorm
assert HorovodInternalError is hvd_trainer.HorovodInternalError
assert horovod.run is not None and horovod.__version__ == hvd_trainer.__version__
assert hvd_trainer.torch.__spec__.name == "hvd_trainer.torch"   # the real module is untouched
for missing, hint in (("horovod.spark", "TorchDistributor"),
                      ("horovod.torch.nothing_here", "hvd_trainer.torch")):
    try:
        __import__(missing)
    except ModuleNotFoundError as exc:
        assert hint in str(exc), exc
    else:
        raise AssertionError(missing)
print("OK")
"""


def test_alias_serves_horovod_modules_as_the_hvd_trainer_modules() -> None:
    assert _python(MAPPING).strip().endswith("OK")


RUNNER_THREADS = """
import threading
import hvd_trainer.horovod_alias
from horovod.runner.util.threads import execute_function_multithreaded, in_thread, on_event
got = []
in_thread(got.append, args=("a",)).join()
in_thread(lambda: 1 / 0, silent=True).join()
event = threading.Event()
waiter = on_event(event, got.append, args=("b",), check_stop_interval_s=0.01)
event.set()
waiter.join()
print(got, execute_function_multithreaded(lambda x, y: x * y, [(1, 2), (3, 4)], max_concurrent_executions=1))
try:
    in_thread(print, args="x")
except ValueError as exc:
    print("refused:", exc)
"""


def test_horovod_runner_threads_for_horovods_test_helpers() -> None:
    """Horovod's test/utils/common.py imports horovod.runner.util.threads (its tests did not load)."""
    out = _python(RUNNER_THREADS)
    assert "['a', 'b'] {0: 2, 1: 12}" in out, out
    assert "refused: args must be a tuple, not str" in out, out


def test_keras_names() -> None:
    code = ("import hvd_trainer.horovod_alias, hvd_trainer.keras\n"
            "import horovod.tensorflow.keras as a, horovod.keras as b, horovod.keras.callbacks as c\n"
            "import horovod.tensorflow as t\n"
            "assert a is b is hvd_trainer.keras and c is hvd_trainer.keras.callbacks\n"
            "assert t.init is hvd_trainer.keras.init and t.keras is a\nprint('OK')")
    assert _python(code, KERAS_BACKEND="torch").strip().endswith("OK")


def test_alias_never_shadows_an_installed_horovod_unless_forced(tmp_path: Path) -> None:
    real = _fake_horovod(tmp_path)
    code = ("import hvd_trainer.horovod_alias; import horovod.torch as h; "
            "print(getattr(h, 'REAL_TORCH', False))")
    assert _python(code, real).strip() == "True"
    forced = ("import hvd_trainer.horovod_alias as a; a.install(force=True); import horovod.torch as h; "
              "print(h.__name__)")
    assert _python(forced, real).strip() == "hvd_trainer.torch"


def test_shim_on_pythonpath(tmp_path: Path) -> None:
    """What --as-horovod gives a worker: torch is not imported until ``import horovod``, an
    installed Horovod wins unless forced, and a sitecustomize further down the path still runs."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    code = ("import os, sys; assert os.environ.get('USER_SITECUSTOMIZE') == 'ran'\n"
            "assert 'torch' not in sys.modules\n"
            "import horovod.torch as hvd; print(hvd.__name__, getattr(hvd, 'REAL_TORCH', False))")
    site = str(tmp_path / "site")
    alias = {"HVDRUN_AS_HOROVOD": "alias"}
    assert _python(code, HOROVOD_SHIM_DIR, site, **alias).split() == ["hvd_trainer.torch", "False"]
    real = _fake_horovod(tmp_path)
    assert _python(code, HOROVOD_SHIM_DIR, site, real, **alias).split() == ["horovod.torch", "True"]
    # every hvdrun worker has the shim; without --as-horovod, `horovod` is not aliased
    plain = "import sys; assert 'torch' not in sys.modules; import horovod"
    proc = subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([HOROVOD_SHIM_DIR, str(ROOT)])})
    assert proc.returncode == 1 and "No module named 'horovod'" in proc.stderr
    forced = _python(code, HOROVOD_SHIM_DIR, site, real, HVDRUN_AS_HOROVOD="force")
    assert forced.split() == ["hvd_trainer.torch", "False"]


@pytest.mark.parametrize(("flag", "mode"), [("--as-horovod", "alias"), ("--as-horovod=force", "force")])
def test_hvdrun_flag(flag: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/user/path")
    opts, _ = parse_options(["-np", "2", flag, "python", "train.py", "--as-horovod"])
    assert opts is not None and opts.as_horovod == mode
    assert opts.command == ["python", "train.py", "--as-horovod"]
    env = worker_env(opts)
    assert env["PYTHONPATH"] == os.pathsep.join([HOROVOD_SHIM_DIR, "/user/path"])
    assert env["HVDRUN_AS_HOROVOD"] == mode
    opts, _ = parse_options(["-np", "2", "python", "train.py"])
    assert opts is not None and "HVDRUN_AS_HOROVOD" not in worker_env(opts)


GRAD_ENV = """
import os
import hvd_trainer.horovod_alias as alias
print(os.environ.get("HVD_TRAINER_REDUCESCATTER_GRAD"))
alias.uninstall()
print(os.environ.get("HVD_TRAINER_REDUCESCATTER_GRAD"))
"""


@pytest.mark.parametrize(("user", "expected"), [(None, ["horovod", "None"]),
                                               ("adjoint", ["adjoint", "adjoint"])])
def test_alias_gives_horovods_reducescatter_gradient_unless_the_user_chose(user: str | None,
                                                                          expected: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HVD_TRAINER_REDUCESCATTER_GRAD"}
    if user is not None:
        env["HVD_TRAINER_REDUCESCATTER_GRAD"] = user
    proc = subprocess.run([sys.executable, "-c", GRAD_ENV], capture_output=True, text=True, timeout=120,
                          env={**env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == expected


LIGHTNING_ONLY = """
import sys
import pytorch_lightning as pl
from pytorch_lightning.strategies import StrategyRegistry
print("horovod" in StrategyRegistry, "hvd_trainer.strategy" in sys.modules, "horovod" in sys.modules)
"""


def test_shim_registers_the_strategy_when_lightning_is_imported() -> None:
    """Every hvdrun worker has the shim first on its path: importing Lightning alone registers
    ``"horovod"`` (no ``import hvd_trainer``), and ``horovod`` stays unaliased without the flag."""
    assert _python(LIGHTNING_ONLY, HOROVOD_SHIM_DIR).split() == ["True", "True", "False"]
    assert _python(LIGHTNING_ONLY).split() == ["False", "False", "False"]  # without the shim


def test_shim_in_a_python_without_hvd_trainer_warns_and_lets_lightning_load(tmp_path: Path) -> None:
    (tmp_path / "pytorch_lightning.py").write_text("LOADED = True\n")  # a stand-in Lightning
    code = "import pytorch_lightning; print(pytorch_lightning.LOADED)"
    start = f"import sys; sys.path[:0] = {[HOROVOD_SHIM_DIR, str(tmp_path)]!r}; import sitecustomize; "
    proc = subprocess.run([sys.executable, "-I", "-c", start + code],  # -I: no hvd_trainer on the path
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True"]
    assert "could not register Trainer(strategy='horovod')" in proc.stderr and "HINT:" in proc.stderr


def test_every_worker_gets_the_shim_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/user/path")
    opts, _ = parse_options(["-np", "2", "python", "train.py"])
    assert opts is not None
    assert worker_env(opts)["PYTHONPATH"] == os.pathsep.join([HOROVOD_SHIM_DIR, "/user/path"])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([HOROVOD_SHIM_DIR, "/user/path"]))  # nested hvdrun
    assert worker_env(opts)["PYTHONPATH"] == os.pathsep.join([HOROVOD_SHIM_DIR, "/user/path"])

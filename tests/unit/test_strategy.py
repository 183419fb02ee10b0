"""HorovodStrategy arguments and registration (single process; training is in tests/dist)."""

from __future__ import annotations

import subprocess

import pytest

import hvd_trainer  # noqa: F401
from hvd_trainer.comm.reduce.fusion import FusionConfig
from hvd_trainer.strategy import HorovodStrategy, StrategyConfigError
from tests.interpreters import run_at_once


def test_registered_once_and_idempotent() -> None:
    from pytorch_lightning.strategies import StrategyRegistry

    from hvd_trainer._register import register

    assert StrategyRegistry["horovod"]["strategy"] is HorovodStrategy
    register()  # a second registration is a no-op, not a "name already registered" error
    assert isinstance(StrategyRegistry.get("horovod"), HorovodStrategy)


FIRST_IMPORTS = ["hvd_trainer.lightning.elastic", "hvd_trainer.lightning.callbacks",
                 "hvd_trainer.lightning.cluster_env", "hvd_trainer.lightning.plugins",
                 "hvd_trainer.lightning.checkpoint_io", "hvd_trainer.strategy", "pytorch_lightning"]


@pytest.fixture(scope="module")
def first_import_runs() -> dict[str, subprocess.CompletedProcess]:
    """One fresh interpreter per first import, all started at once, warnings as errors."""
    codes = [f"import {first_import}\n"
             "import hvd_trainer\n"
             "from pytorch_lightning.strategies import StrategyRegistry\n"
             "from hvd_trainer.strategy import HorovodStrategy\n"
             "assert StrategyRegistry['horovod']['strategy'] is HorovodStrategy\n"
             for first_import in FIRST_IMPORTS]
    runs = run_at_once(codes, flags=["-W", "error::UserWarning"])
    return dict(zip(FIRST_IMPORTS, runs, strict=True))


@pytest.mark.parametrize("first_import", FIRST_IMPORTS)
def test_registered_whichever_module_is_imported_first(
        first_import: str, first_import_runs: dict[str, subprocess.CompletedProcess]) -> None:
    # A fresh interpreter: importing any Lightning-side module first must neither warn (a
    # half-initialised module met by the import hook) nor leave "horovod" out.
    done = first_import_runs[first_import]
    assert done.returncode == 0, done.stderr[-3000:]


def test_fusion_kwargs_reach_the_comm_config() -> None:
    s = HorovodStrategy(fusion_threshold_bytes=1024, first_bucket_bytes=0)
    assert s._fusion == FusionConfig(fusion_threshold_bytes=1024, first_bucket_bytes=0)
    assert s.is_distributed is True and s.handles_gradient_accumulation is False


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(fusion_threshold_bytes=-1), "fusion_threshold_bytes=-1"),
        (dict(first_bucket_bytes=1.5), "first_bucket_bytes=1.5"),
        (dict(timeout_seconds=0), "timeout_seconds=0"),
        (dict(compression="int4"), "compression='int4'"),
        (dict(compression="powersgd:2", sync_every=4), "compression='powersgd"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, needle: str) -> None:
    with pytest.raises(StrategyConfigError, match=needle) as info:
        HorovodStrategy(**kwargs)
    assert "HINT" in str(info.value)


def test_unknown_kwarg_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="fusion_threshold_mb"):
        HorovodStrategy(fusion_threshold_mb=64)


def test_compression_accepts_names_and_compressors() -> None:
    from hvd_trainer import Compression

    assert HorovodStrategy(compression="fp16")._compression is Compression.fp16
    assert HorovodStrategy(compression=Compression.bf16)._compression is Compression.bf16
    assert HorovodStrategy()._compression is Compression.none


_LAZY = """
import sys
import hvd_trainer
assert "pytorch_lightning" not in sys.modules, "import hvd_trainer must not import Lightning"
import hvd_trainer.keras.callbacks  # noqa: F401  (nor do the other front ends)
assert "pytorch_lightning" not in sys.modules
from pytorch_lightning import Trainer
print(type(Trainer(strategy="horovod", logger=False).strategy).__name__)
"""


def test_registration_waits_for_lightning_import() -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, KERAS_BACKEND="torch")
    proc = subprocess.run([sys.executable, "-c", _LAZY], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "HorovodStrategy"

"""HorovodStrategy arguments and registration (single process; training is in tests/dist)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import hvd_trainer  # noqa: F401
from hvd_trainer.comm.reduce.fusion import FusionConfig
from hvd_trainer.strategy import HorovodStrategy, StrategyConfigError
from tests.interpreters import run_at_once

ROOT = Path(__file__).resolve().parents[2]


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
        # every spelling the strategy accepts is listed (compression_spellings, one list)
        (dict(compression="int4"), "'int8', 'powersgd', 'powersgd:R' (R >= 1, e.g. 'powersgd:4') or 'auto'"),
        (dict(compression="powersgd:2", sync_every=4), "compression='powersgd"),
        (dict(zero_stage="2"), "zero_stage must be an int 0, 1 or 2, got the str '2'. HINT: zero_stage=2"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, needle: str) -> None:
    with pytest.raises(StrategyConfigError, match=re.escape(needle)) as info:
        HorovodStrategy(**kwargs)
    assert "HINT" in str(info.value)


def test_unknown_kwarg_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="fusion_threshold_mb"):
        HorovodStrategy(fusion_threshold_mb=64)


def test_compression_accepts_names_and_compressors() -> None:
    from hvd_trainer import Compression

    assert HorovodStrategy(compression="fp16").compression is Compression.fp16
    assert HorovodStrategy(compression=Compression.bf16).compression is Compression.bf16
    assert HorovodStrategy().compression is Compression.none


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


_PROGRESS_BAR_VERSION = """
import json
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import TQDMProgressBar
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset
import hvd_trainer  # noqa: F401

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class Probe(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, *args):
        bar = trainer.progress_bar_callback
        v_num = bar.get_metrics(trainer, pl_module)["v_num"]
        self.seen = {"v_num": v_num, "type": type(v_num).__name__, "version": trainer.logger.version,
                     "postfix": bar.train_progress_bar.postfix}

probe = Probe()
trainer = pl.Trainer(strategy=STRATEGY, accelerator="cpu", devices=1,
                     max_steps=1, logger=CSVLogger(LOGS), callbacks=[TQDMProgressBar(), probe],
                     enable_checkpointing=False, enable_model_summary=False)
trainer.fit(Tiny(), DataLoader(TensorDataset(torch.ones(4, 3)), batch_size=2))
print("JSON" + json.dumps(probe.seen))
"""


def test_progress_bar_version_is_the_loggers_int_as_under_ddp(tmp_path) -> None:
    # The progress bar's v_num is the logger's version (an int), as under Lightning's own ddp;
    # the strategy's reduce/broadcast never touch it. (Lightning's RichProgressBar, its default
    # when `rich` is installed, prints every non-str metric with ".3f", so "v_num: 0.000" there,
    # under ddp too; TQDM prints "v_num=0".)
    import json
    import os

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "HOROVOD_RANK", "HOROVOD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    strategies = ("horovod", "ddp")
    codes = [_PROGRESS_BAR_VERSION.replace("STRATEGY", repr(s)).replace("LOGS", repr(str(tmp_path / s)))
             for s in strategies]
    runs = run_at_once(codes, envs=[env, env], timeout_seconds=240)
    seen = {}
    for strategy, done in zip(strategies, runs, strict=True):
        assert done.returncode == 0, done.stderr[-3000:]
        seen[strategy] = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("JSON")][-1][4:])
    assert seen["horovod"] == seen["ddp"]
    assert seen["horovod"]["v_num"] == seen["horovod"]["version"] == 0 and seen["horovod"]["type"] == "int"
    assert seen["horovod"]["postfix"] == "v_num=0"

"""Spark's ``TorchDistributor`` (``pyspark.ml.torch.distributor``) with ``hvd.init()`` inside.

``TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(fn, ...)`` starts
torchrun on the driver, so ``hvd.init()`` in ``fn`` reads torchrun's variables. Skipped (with
the reason) without pyspark or a Java runtime. One local Spark session per module (~25 s to start
on 2 busy cores).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("pyspark", reason="pyspark not installed (pip install 'hvd_trainer[spark]')")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Spark needs a Java runtime (apt-get install default-jre-headless)", allow_module_level=True)

from pyspark.ml.torch.distributor import TorchDistributor  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from tests.e2e.hvdrun_helpers import ROOT  # noqa: E402
from tests.engines import _loops as loops  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    """A local[2] Spark session without UI, stopped (JVM included) at the end. Its JVM, Python
    workers and torchrun's processes get this checkout on PYTHONPATH (they import
    tests.engines._loops), this interpreter, and no launcher variables of the test process."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        # executors start Python workers with PYSPARK_PYTHON (default: the first python3 on PATH,
        # which under `make test` is not the venv's and lacks pyarrow, torch and hvd_trainer)
        patch.setenv("PYSPARK_PYTHON", sys.executable)
        patch.setenv("PYSPARK_DRIVER_PYTHON", sys.executable)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            patch.delenv(name, raising=False)
        session = (SparkSession.builder.master("local[2]").appName("hvd_trainer-tests")
                   .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
        try:
            yield session
        finally:
            session.stop()


def _check_reports(out: Path) -> None:
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, r in enumerate(reports):
        assert (r["launcher"], r["rank"], r["size"]) == ("torchrun", rank, 2)
        assert r["sum_rank_plus_1"] == 3.0
    assert reports[0]["weights"] == reports[1]["weights"]
    reference = loops.one_process_reference()
    assert max(abs(a - b) for a, b in zip(reports[0]["weights"], reference, strict=True)) < 1e-12


def test_torch_distributor_local_mode_runs_hvd_init(spark: SparkSession, tmp_path: Path) -> None:
    returned = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
        loops.spark_train, str(tmp_path))
    assert returned in (0, 1)  # Spark returns one rank's result
    _check_reports(tmp_path)
    local_ranks = [json.loads((tmp_path / f"rank{r}.json").read_text())["local_rank"] for r in range(2)]
    assert local_ranks == [0, 1]  # one torchrun on the driver with 2 processes


def test_torch_distributor_on_executors_runs_hvd_init(spark: SparkSession, tmp_path: Path) -> None:
    """``local_mode=False``: 2 barrier tasks on the executors, each running torchrun."""
    returned = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        loops.spark_train, str(tmp_path))
    assert returned == 0  # the result of the task of rank 0
    _check_reports(tmp_path)

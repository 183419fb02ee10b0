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
    """A local[2] Spark session without UI, stopped (JVM included) at the end."""
    session = (SparkSession.builder.master("local[2]").appName("hvd_trainer-tests")
               .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    try:
        yield session
    finally:
        session.stop()


def test_torch_distributor_local_mode_runs_hvd_init(spark: SparkSession, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun's workers are children of this process: they import tests.engines._loops.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    returned = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
        loops.spark_train, str(tmp_path))
    assert returned in (0, 1)  # Spark returns one rank's result
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, r in enumerate(reports):
        assert (r["launcher"], r["rank"], r["size"], r["local_rank"]) == ("torchrun", rank, 2, rank)
        assert r["sum_rank_plus_1"] == 3.0
    assert reports[0]["weights"] == reports[1]["weights"]
    reference = loops.one_process_reference()
    assert max(abs(a - b) for a, b in zip(reports[0]["weights"], reference, strict=True)) < 1e-12

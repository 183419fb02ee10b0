"""Ray Train for real: a local 2-CPU Ray cluster, ``TorchTrainer`` with 2 workers, ``hvd.init()``
adopting Ray's process group; torch, Lightning and Keras inside Ray; Ray's failure handling;
``hvd_trainer.ray.run``. Skipped (with the reason) when ``ray[train]`` is not installed.

One Ray cluster per module (starting one costs ~5 s); each ``fit`` starts 2 fresh worker
processes (~10-15 s on 2 cores).
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="ray[train] not installed (pip install 'hvd_trainer[ray]')")
pytest.importorskip("ray.train.torch", reason="ray[train] not installed (pip install 'hvd_trainer[ray]')")

import torch  # noqa: E402
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

import hvd_trainer.ray as hvd_ray  # noqa: E402
from tests.e2e.hvdrun_helpers import clean_env  # noqa: E402
from tests.engines import _loops as loops  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster of 2 CPUs for this module, shut down (all its processes) and its
    directory removed at the end. Workers get this checkout on PYTHONPATH (they import
    tests.engines._loops) and no launcher variables of the test process. The directory is
    short on purpose: Ray's Unix sockets live below it (108-byte path limit)."""
    if ray.is_initialized():
        ray.shutdown()
    env = {k: v for k, v in clean_env().items() if k in ("PYTHONPATH", "OMP_NUM_THREADS")}
    temp_dir = tempfile.mkdtemp(prefix="hvdray", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env},
             _temp_dir=temp_dir, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _run_config(tmp_path: Path, **kwargs: object) -> RunConfig:
    return RunConfig(storage_path=str(tmp_path / "ray_results"), name="run", **kwargs)


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_torch_trainer_loop_adopts_rays_group_and_matches_one_process(tmp_path: Path) -> None:
    TorchTrainer(
        loops.torch_trainer_loop, train_loop_config={"out_dir": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2), run_config=_run_config(tmp_path),
    ).fit()
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for rank, result in enumerate(got):
        assert result["adopted_rays_group"], result  # hvd.init() kept Ray's group, opened none
        assert (result["rank"], result["size"], result["ray_rank"], result["ray_size"]) == (rank, 2, rank, 2)
        assert (result["local_rank"], result["backend"]) == (rank, "gloo")
    reference = loops.one_process_reference()
    assert got[0]["weights"] == got[1]["weights"]
    assert _max_abs_diff(got[0]["weights"], reference) < 1e-12
    assert _max_abs_diff(loops.flat_weights(loops.linear(seed=0)), reference) > 1e-2  # it trained


def test_lightning_strategy_horovod_inside_ray() -> None:
    got = hvd_ray.run(loops.lightning_fit, num_workers=2, env={"HVD_TEST_MARKER": "from-driver"})
    assert [(r["global_rank"], r["world_size"]) for r in got] == [(0, 2), (1, 2)]  # in rank order
    assert {r["strategy"] for r in got} == {"HorovodStrategy"}
    assert [r["marker"] for r in got] == ["from-driver"] * 2  # run(env=...) reached the workers
    assert [r["steps"] for r in got] == [4, 4]  # 16 rows / 2 ranks / batch 4, 2 epochs
    assert got[0]["weights"] == got[1]["weights"]  # rank 0's init broadcast, averaged gradients
    assert _max_abs_diff(got[0]["weights"], got[0]["initial"]) > 1e-3


def test_keras_torch_backend_fit_inside_ray() -> None:
    got = hvd_ray.run(loops.keras_fit, num_workers=2)
    assert [(r["rank"], r["size"], r["backend"]) for r in got] == [(0, 2, "torch"), (1, 2, "torch")]
    flat = [[x for w in r["weights"] for x in torch.tensor(w).reshape(-1).tolist()] for r in got]
    assert _max_abs_diff(flat[0], flat[1]) < 1e-6
    assert all(math.isfinite(x) for x in flat[0])


def test_failure_config_resumes_from_the_checkpoint_after_a_worker_is_killed(tmp_path: Path) -> None:
    epochs, kill_after = 6, 2
    result = TorchTrainer(
        loops.resumable_loop, train_loop_config={"out_dir": str(tmp_path), "epochs": epochs,
                                                 "kill_after": kill_after},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=_run_config(tmp_path, failure_config=FailureConfig(max_failures=1)),
    ).fit()
    assert result.error is None
    for rank in range(2):
        starts = sorted(tmp_path.glob(f"starts_rank{rank}.*"))
        assert [p.suffix for p in starts] == [".0", ".1"], starts  # killed once, restarted once
        first, second = (int(p.read_text()) for p in starts)
        assert first == 0
        # Resumed from a reported checkpoint (epoch k saved -> start at k + 1), not from scratch.
        assert 1 <= second <= kill_after + 1, second
    finals = [torch.load(tmp_path / f"final_rank{r}.pt", weights_only=True) for r in range(2)]
    assert finals[0] == finals[1]
    # Exactly `epochs` steps in total: same weights as one uninterrupted process.
    assert _max_abs_diff(finals[0], loops.one_process_reference(steps=epochs)) < 1e-12


def test_run_names_the_failing_rank() -> None:
    with pytest.raises(hvd_ray.RayRunError, match=r"rank 1 raised KeyError") as info:
        hvd_ray.run(loops.fails_on_rank_1, num_workers=2)
    assert info.value.rank == 1
    assert set(info.value.failures) == {1}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_workers": 0}, r"num_workers=0\): expected an int >= 1"),
    ({"num_workers": 2, "gpus_per_worker": 1}, "HINT: pass use_gpu=True"),
    ({"num_workers": 2, "cpus_per_worker": 0}, r"cpus_per_worker=0\)"),
    ({"num_workers": 2, "max_failures": -2}, r"max_failures=-2\)"),
])
def test_run_rejects_bad_arguments_before_starting_anything(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hvd_ray.run(print, **kwargs)


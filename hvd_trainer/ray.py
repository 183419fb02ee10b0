"""``hvd_trainer.ray.run(fn, num_workers=N)``: Horovod's ``RayExecutor`` as one call, on Ray Train.

Horovod's Ray integration started its own actors and rendezvous server; Ray Train's
``TorchTrainer`` now starts the workers, creates the ``torch.distributed`` process group and
exports ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
in every worker. ``hvd.init()`` inside the worker adopts that group (it never opens a second one),
so a function written for ``RayExecutor.run`` runs unchanged. This module uses Ray Train's public
API only (``TorchTrainer``, ``ScalingConfig``, ``RunConfig``, ``FailureConfig``,
``ray.train.get_context``) plus one Ray actor that collects the per-rank return values.

Porting from Horovod::

    # Horovod                                         # hvd_trainer
    settings = RayExecutor.create_settings(timeout_s=30)
    ex = RayExecutor(settings, num_workers=4,          results = hvd_trainer.ray.run(
                     cpus_per_worker=2, use_gpu=True)      train, args=(cfg,), num_workers=4,
    ex.start(extra_env_vars={"NCCL_DEBUG": "INFO"})        cpus_per_worker=2, use_gpu=True,
    results = ex.run(train, args=[cfg])                    env={"NCCL_DEBUG": "INFO"})
    ex.shutdown()

Differences from ``RayExecutor`` (by design): every call starts a fresh worker group, so state
does not persist between calls (no ``execute``/``execute_single``); ``max_failures`` restarts the
whole group (Ray Train's ``FailureConfig``), and a function that reports checkpoints with
``ray.train.report(..., checkpoint=...)`` resumes from ``ray.train.get_checkpoint()``.

Ray is an optional dependency: ``pip install 'hvd_trainer[ray]'``. This module sits beside the
launchers: nothing in ``hvd_trainer`` imports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

try:
    import ray
    import ray.train
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
except ImportError as _exc:  # pragma: no cover - exercised only without ray installed
    raise ImportError(
        f"hvd_trainer.ray needs Ray Train ({_exc}). HINT: pip install 'hvd_trainer[ray]' "
        "(or pip install 'ray[train]')."
    ) from _exc

__all__ = ["run", "RayRunError"]


class RayRunError(RuntimeError):
    """A rank of :func:`run` raised (after Ray Train's retries, if any).

    Attributes:
        rank: the lowest rank that failed (``-1`` when Ray reported no rank, e.g. a controller
            error).
        failures: ``{rank: exception}`` as Ray Train reported them.
    """

    def __init__(self, message: str, rank: int, failures: Mapping[int, BaseException]) -> None:
        super().__init__(message)
        self.rank = rank
        self.failures = dict(failures)


@ray.remote(num_cpus=0)
class _ResultBoard:
    """Holds each rank's return value until the driver collects them (0 CPUs: never competes
    with the workers for resources)."""

    def __init__(self) -> None:
        self._results: dict[int, Any] = {}

    def put(self, rank: int, value: Any) -> None:
        self._results[rank] = value

    def results(self) -> dict[int, Any]:
        return self._results


def _worker_loop(config: dict[str, Any]) -> None:
    """Runs inside every Ray Train worker: call ``fn`` and hand its result to the board."""
    fn, args, kwargs = config["fn"], config["args"], config["kwargs"]
    value = fn(*args, **kwargs)
    config["board"].put.remote(ray.train.get_context().get_world_rank(), value)


def _check_arguments(num_workers: int, cpus_per_worker: float, gpus_per_worker: float | None,
                     use_gpu: bool, max_failures: int) -> None:
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"run(num_workers={num_workers!r}): expected an int >= 1. "
                         "HINT: num_workers is the number of training processes (Horovod's np).")
    if cpus_per_worker <= 0:
        raise ValueError(f"run(cpus_per_worker={cpus_per_worker!r}): expected a number > 0.")
    if gpus_per_worker is not None and not use_gpu:
        raise ValueError(f"run(gpus_per_worker={gpus_per_worker!r}) with use_gpu=False. "
                         "HINT: pass use_gpu=True to give workers GPUs.")
    if max_failures < -1:
        raise ValueError(f"run(max_failures={max_failures!r}): expected -1 (retry forever), 0 or more.")


def _resources(cpus_per_worker: float, use_gpu: bool, gpus_per_worker: float | None) -> dict[str, float]:
    resources: dict[str, float] = {"CPU": cpus_per_worker}
    if use_gpu:
        resources["GPU"] = 1 if gpus_per_worker is None else gpus_per_worker
    return resources


def _raise_with_ranks(exc: BaseException) -> None:
    failures: dict[int, BaseException] = dict(getattr(exc, "worker_failures", None) or {})
    rank = min(failures) if failures else -1
    what = "; ".join(f"rank {r} raised {type(e).__name__}: {e}" for r, e in sorted(failures.items()))
    raise RayRunError(
        f"hvd_trainer.ray.run: {what or exc}. HINT: the worker's traceback is in the chained "
        "Ray error above; pass max_failures=N to let Ray Train restart the workers.",
        rank, failures,
    ) from exc


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    num_workers: int,
    use_gpu: bool = False,
    cpus_per_worker: float = 1,
    gpus_per_worker: float | None = None,
    max_failures: int = 0,
    env: Mapping[str, str] | None = None,
    storage_path: str | os.PathLike[str] | None = None,
    name: str | None = None,
    backend: str | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_workers`` Ray Train workers; return results by rank.

    ``fn`` usually starts with ``hvd.init()``, which adopts the process group Ray Train made
    (gloo on CPU workers, NCCL with ``use_gpu=True``). ``fn``, its arguments and its return
    value travel with Ray's serializer (cloudpickle), so closures and functions defined in
    ``__main__`` work. Connects to the Ray cluster of ``ray.init()`` if it was called, else
    starts a local one, as ``TorchTrainer.fit`` does.

    Args:
        fn: the training function, run once on every worker.
        args, kwargs: its positional and keyword arguments (the same on every worker).
        num_workers: number of training processes (Horovod's ``num_workers``/``np``).
        use_gpu: one GPU per worker (``gpus_per_worker`` to change the share).
        cpus_per_worker: CPUs Ray reserves per worker.
        gpus_per_worker: GPUs per worker when ``use_gpu`` (default 1).
        max_failures: how often Ray Train restarts the whole worker group after a failure
            (``-1``: forever). The function sees ``ray.train.get_checkpoint()`` of the last
            ``ray.train.report(checkpoint=...)`` after a restart.
        env: environment variables set in every worker before ``fn`` runs (Horovod's
            ``start(extra_env_vars=...)``).
        storage_path: where Ray Train keeps checkpoints and run state (default: Ray's,
            ``~/ray_results``); must be shared storage on a multi-node cluster.
        name: run name under ``storage_path`` (default: Ray's generated name).
        backend: ``"gloo"``/``"nccl"`` for the process group (default: Ray's choice).

    Returns:
        ``[result of rank 0, result of rank 1, ...]`` (``num_workers`` items).

    Raises:
        ValueError: an argument is out of range (the message names it).
        RayRunError: a worker raised or died and no retry was left; ``rank`` names the lowest
            failing rank and the Ray error is chained.
    """
    _check_arguments(num_workers, cpus_per_worker, gpus_per_worker, use_gpu, max_failures)
    board = _ResultBoard.remote()
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config={"fn": fn, "args": tuple(args), "kwargs": dict(kwargs or {}), "board": board},
        torch_config=TorchConfig(backend=backend) if backend else None,
        scaling_config=ScalingConfig(
            num_workers=num_workers, use_gpu=use_gpu,
            resources_per_worker=_resources(cpus_per_worker, use_gpu, gpus_per_worker),
        ),
        run_config=RunConfig(
            name=name, storage_path=None if storage_path is None else os.fspath(storage_path),
            failure_config=FailureConfig(max_failures=max_failures),
            worker_runtime_env={"env_vars": dict(env)} if env else None,
        ),
    )
    try:
        trainer.fit()
        results: dict[int, Any] = ray.get(board.results.remote())
    except ray.train.TrainingFailedError as exc:
        _raise_with_ranks(exc)
    finally:
        ray.kill(board)
    missing = sorted(set(range(num_workers)) - set(results))
    if missing:
        raise RayRunError(f"hvd_trainer.ray.run: ranks {missing} returned no result. HINT: a worker "
                          "exited without raising (os._exit?); check its output above.", missing[0], {})
    return [results[rank] for rank in range(num_workers)]

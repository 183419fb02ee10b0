"""Training functions that run inside engine workers (tests/engines: Ray Train, Spark).

Imported by the workers by module name (Ray and Spark pickle these functions by reference), so this
module imports nothing heavy at the top: each function imports what it needs. Every function
returns plain Python data (or writes it under ``out_dir``); the test process asserts on it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

N_IN, ROWS, STEPS, LR = 4, 16, 5, 0.1
"""Linear regression: ROWS rows (the global batch) of N_IN features, STEPS steps of SGD at LR."""


def regression_data() -> tuple[Any, Any]:
    """The global batch, float64: ``x`` (ROWS, N_IN), ``y`` (ROWS, 1)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, N_IN, generator=g, dtype=torch.float64)
    y = x @ torch.arange(1.0, N_IN + 1, dtype=torch.float64)[:, None] + 0.5
    return x, y


def linear(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Linear(N_IN, 1).double()


def one_process_reference(steps: int = STEPS) -> list[float]:
    """What one process computes in ``steps`` steps on the whole global batch (rank 0's
    initial weights)."""
    import torch

    x, y = regression_data()
    model = linear(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return flat_weights(model)


def flat_weights(model: Any) -> list[float]:
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def distributed_sgd(world: Any) -> list[float]:
    """Rank 0's weights broadcast, then STEPS steps of ``DistributedOptimizer`` on this rank's
    share of the global batch; the final weights."""
    import torch

    import hvd_trainer.torch as hvd

    model = linear(seed=world.rank)  # ranks start different; the broadcast makes them equal
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters())
    x, y = regression_data()
    mine = slice(world.rank * ROWS // world.size, (world.rank + 1) * ROWS // world.size)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
    return flat_weights(model)


def torch_optimizer_fit() -> dict[str, Any]:
    """hvd.init() inside a Ray Train worker, then :func:`distributed_sgd`."""
    import ray.train
    import torch
    import torch.distributed as dist

    import hvd_trainer.torch as hvd

    torch.set_num_threads(1)
    group_before = dist.group.WORLD if dist.is_initialized() else None
    world = hvd.init()
    ctx = ray.train.get_context()
    weights = distributed_sgd(world)
    return {
        "rank": world.rank, "size": world.size, "local_rank": world.local_rank,
        "backend": world.backend, "ray_rank": ctx.get_world_rank(), "ray_size": ctx.get_world_size(),
        "adopted_rays_group": group_before is not None and world.group is group_before,
        "weights": weights,
    }


def spark_train(out_dir: str) -> int:
    """The function given to Spark's ``TorchDistributor.run``: hvd.init(), distributed SGD,
    this rank's report to ``out_dir/rank<r>.json``; returns the rank."""
    import json

    import torch

    import hvd_trainer.torch as hvd
    from hvd_trainer.comm.world.world import detect_launch_env

    torch.set_num_threads(1)
    launcher = detect_launch_env().launcher
    world = hvd.init()
    total = hvd.allreduce(torch.tensor([float(world.rank + 1)]), op=hvd.Sum).item()
    report = {"rank": world.rank, "size": world.size, "local_rank": world.local_rank,
              "launcher": launcher, "sum_rank_plus_1": total, "weights": distributed_sgd(world)}
    (Path(out_dir) / f"rank{world.rank}.json").write_text(json.dumps(report))
    return world.rank


def torch_trainer_loop(config: dict[str, Any]) -> None:
    """A plain ``TorchTrainer`` loop: the result of :func:`torch_optimizer_fit` to a file."""
    import torch

    result = torch_optimizer_fit()
    torch.save(result, Path(config["out_dir"]) / f"rank{result['rank']}.pt")


def lightning_fit() -> dict[str, Any]:
    """``Trainer(strategy="horovod")`` inside a Ray Train worker (Ray made the process group)."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import hvd_trainer  # noqa: F401 - registers strategy="horovod"

    torch.set_num_threads(1)

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = linear(seed=int(os.environ["RANK"]))  # different per rank until setup

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR)

    x, y = regression_data()
    module = Regression()
    trainer = pl.Trainer(strategy="horovod", accelerator="cpu", max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=4))
    return {"global_rank": trainer.global_rank, "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__, "steps": trainer.global_step,
            "weights": flat_weights(module.net),
            "initial": flat_weights(linear(seed=int(os.environ["RANK"]))),
            "marker": os.environ.get("HVD_TEST_MARKER")}


def keras_fit() -> dict[str, Any]:
    """Keras 3 (torch backend) ``fit`` with hvd_trainer.keras inside a Ray Train worker."""
    os.environ["KERAS_BACKEND"] = "torch"  # a fresh worker process: keras not imported yet
    import keras
    import numpy as np

    import hvd_trainer.keras as hk

    hk.init()
    keras.utils.set_random_seed(100 + hk.rank())  # ranks start different
    model = keras.Sequential([keras.Input((N_IN,)), keras.layers.Dense(3, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    rs = np.random.RandomState(hk.rank())  # each rank its own data
    x = rs.randn(32, N_IN).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0,
              callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0)])
    return {"rank": hk.rank(), "size": hk.size(), "backend": keras.backend.backend(),
            "weights": [w.tolist() for w in model.get_weights()]}


def fails_on_rank_1() -> None:
    import torch

    import hvd_trainer.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("missing column 'label'")
    hvd.allreduce(torch.ones(1))  # rank 0 waits for rank 1, which never comes


def resumable_loop(config: dict[str, Any]) -> None:
    """EPOCHS epochs of DistributedOptimizer with a Ray checkpoint after each; on the first
    attempt rank 1 kills itself with SIGKILL after epoch ``kill_after`` was reported.

    Each rank appends ``(attempt, start_epoch)`` to ``out_dir/starts_rank<r>.txt`` and writes its
    final weights to ``out_dir/final_rank<r>.pt``.
    """
    import signal
    import tempfile

    import ray.train
    import torch

    import hvd_trainer.torch as hvd

    torch.set_num_threads(1)
    out = Path(config["out_dir"])
    world = hvd.init()
    model = linear(seed=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters())
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as path:
            state = torch.load(Path(path) / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["epoch"] + 1
    attempt = len(list(out.glob(f"starts_rank{world.rank}.*")))
    (out / f"starts_rank{world.rank}.{attempt}").write_text(str(start))
    x, y = regression_data()
    mine = slice(world.rank * ROWS // world.size, (world.rank + 1) * ROWS // world.size)
    for epoch in range(start, config["epochs"]):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        with tempfile.TemporaryDirectory() as tmp:
            if world.rank == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                           Path(tmp) / "state.pt")
            ray.train.report({"epoch": epoch},
                             checkpoint=ray.train.Checkpoint.from_directory(tmp) if world.rank == 0 else None)
        if attempt == 0 and epoch == config["kill_after"] and world.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save(flat_weights(model), out / f"final_rank{world.rank}.pt")

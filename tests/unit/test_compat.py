"""The framework internals hvd_trainer relies on are still there, with the signatures we use.

One test per internal, named after it, against the installed torch, Lightning, Keras and
TensorFlow: an upgrade that renames or changes one fails here, by name, instead of in a distant
end-to-end test. They are listed in hvd_trainer/comm/base/_torch_compat.py,
hvd_trainer/lightning/_compat.py and hvd_trainer/keras/_compat.py. Where a private use was
replaced by public API, the test checks the public behaviour the replacement relies on.

Keras runs in one subprocess (torch backend), so no backend choice leaks into other tests.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import hvd_trainer as hvd
from hvd_trainer.comm.base import _torch_compat
from hvd_trainer.comm.base.store import default_store

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def _params(fn: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(fn).parameters)


@pytest.fixture
def world_of_one() -> Iterator[hvd.World]:
    world = hvd.init()
    try:
        yield world
    finally:
        hvd.shutdown()


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


# -- torch ------------------------------------------------------------------------------------
def test_torch_distributed_c10d_get_default_store(world_of_one: hvd.World) -> None:
    assert _params(dist.distributed_c10d._get_default_store) == []
    store = _torch_compat.default_store()
    assert isinstance(store, dist.Store)
    store.set("hvd_trainer_compat", "yes")
    assert store.get("hvd_trainer_compat") == b"yes"
    assert default_store() is not None


def test_torch_default_store_is_none_before_init() -> None:
    assert not dist.is_initialized()
    assert default_store() is None


def test_torch_nn_batchnorm_base_class() -> None:
    base = _torch_compat.BatchNormBase
    assert base is torch.nn.modules.batchnorm._BatchNorm
    for cls in (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm,
                torch.nn.LazyBatchNorm2d):
        assert issubclass(cls, base), cls
    assert not issubclass(torch.nn.GroupNorm, base) and not issubclass(torch.nn.InstanceNorm2d, base)
    bn = torch.nn.BatchNorm2d(3)
    for name in ("num_features", "eps", "momentum", "affine", "track_running_stats", "running_mean",
                 "running_var", "num_batches_tracked"):
        assert hasattr(bn, name), name  # what convert_sync_batchnorm copies


class _ScalerAware(torch.optim.Optimizer):
    """An optimizer that handles GradScaler's scale itself (as fused Adam does)."""

    _step_supports_amp_scaling = True
    saw_grad_scale: bool | None = None

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure: Any = None) -> None:
        self.saw_grad_scale = hasattr(self, "grad_scale")  # GradScaler hands over its scale


def test_torch_amp_step_supports_amp_scaling_flag(world_of_one: hvd.World) -> None:
    assert _torch_compat.AMP_SCALING_FLAG == "_step_supports_amp_scaling"
    w = torch.nn.Parameter(torch.ones(2))
    inner = _ScalerAware([w])
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale((w * 3).sum()).backward()
    scaler.step(inner)
    assert inner.saw_grad_scale is True, "GradScaler no longer reads _step_supports_amp_scaling"
    wrapper = hvd.DistributedOptimizer(_ScalerAware([torch.nn.Parameter(torch.ones(2))]))
    try:
        assert getattr(wrapper, _torch_compat.AMP_SCALING_FLAG) is False  # not the inner optimizer's True
    finally:
        wrapper.remove_hooks()


class _NoDifferentiableDefault(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.5})
        self.defaults.pop("differentiable", None)  # as a third-party optimizer may have it

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(group["lr"] * p.grad)


def test_torch_optimizer_bookkeeping_from_setstate(world_of_one: hvd.World) -> None:
    """DistributedOptimizer skips Optimizer.__init__; Optimizer.__setstate__ must create every
    hook table that __init__ creates, so the public hook API works on the wrapper."""
    made_by_init = {k for k in vars(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0))
                    if k.startswith("_optimizer_") or k == "_zero_grad_profile_name"}
    assert len(made_by_init) >= 7, made_by_init
    w = torch.nn.Parameter(torch.ones(2))
    inner = _NoDifferentiableDefault([w])
    assert inner.defaults == {"lr": 0.5}
    opt = hvd.DistributedOptimizer(inner, [("w", w)])
    try:
        missing = made_by_init - set(vars(opt))
        assert not missing, f"Optimizer.__init__ creates {missing}, Optimizer.__setstate__ does not"
        assert inner.defaults == {"lr": 0.5}  # the wrapped optimizer's defaults are untouched
        seen: list[str] = []
        opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(f"pre:{type(o).__name__}"))
        opt.register_step_post_hook(lambda o, args, kwargs: seen.append(f"post:{type(o).__name__}"))
        opt.register_state_dict_pre_hook(lambda o: None)
        opt.register_load_state_dict_post_hook(lambda o: None)
        (w * 2).sum().backward()
        opt.step()
        assert seen == ["pre:DistributedOptimizer", "post:DistributedOptimizer"]
        assert w.tolist() == [0.0, 0.0]  # 1 - 0.5 * 2
    finally:
        opt.remove_hooks()


def test_torch_sync_batchnorm_checks_its_input_itself() -> None:
    """Replaced private: SyncBatchNorm._check_input_dim / _check_non_zero_input_channels."""
    layer = hvd.SyncBatchNorm(3)
    with pytest.raises(ValueError, match=r"expected at least 2D input \(got 1D input\)"):
        layer(torch.ones(3))
    with pytest.raises(ValueError, match="number of input channels should be non-zero"):
        hvd.SyncBatchNorm(0)(torch.ones(2, 0))
    assert layer(torch.randn(4, 3)).shape == (4, 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torch_elastic_rendezvous_handler_interface() -> None:
    """Replaced private: StaticTCPRendezvous._store. hvdrun's loopback rendezvous implements the
    public RendezvousHandler and answers as torch's static rendezvous does for one node."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    from hvd_trainer.launch import loopback

    loopback._register()
    port = _free_port()
    params = RendezvousParameters(backend=loopback.BACKEND, endpoint=f"127.0.0.1:{port}", run_id="job",
                                  min_nodes=1, max_nodes=1, timeout=30)
    handler = rendezvous_handler_registry.create_handler(params)  # also checks get_backend()
    static = StaticTCPRendezvous("127.0.0.1", port, 0, 1, "job", 30)  # not started: binds nothing
    for ask in ("is_closed", "num_nodes_waiting", "get_run_id", "shutdown"):
        assert getattr(handler, ask)() == getattr(static, ask)(), ask
    assert handler.use_agent_store is static.use_agent_store is True
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    bootstrap = info.bootstrap_store_info
    assert (bootstrap.master_addr, bootstrap.master_port) == ("127.0.0.1", port)
    info.store.set("k", "v")
    assert handler.store.get("job/k") == b"v"  # the run id prefixes keys, as in the static handler
    with socket.socket() as probe:  # the store listens on loopback only
        assert probe.connect_ex(("127.0.0.1", port)) == 0


# -- Lightning --------------------------------------------------------------------------------
def _trainer(**kwargs: Any) -> Any:
    import pytorch_lightning as pl

    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(**{**defaults, **kwargs})


def _tiny_module() -> Any:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2)

    return Tiny()


def test_lightning_subprocess_script_launcher(no_launcher: None) -> None:
    from pytorch_lightning.strategies import Strategy
    from pytorch_lightning.strategies.launchers import _SubprocessScriptLauncher

    from hvd_trainer.lightning._compat import SubprocessScriptLauncher
    from hvd_trainer.strategy import HorovodStrategy

    assert SubprocessScriptLauncher is _SubprocessScriptLauncher
    assert _params(_SubprocessScriptLauncher.__init__)[:4] == [
        "self", "cluster_environment", "num_processes", "num_nodes"]
    # Strategy._configure_launcher (our override) is called by the Trainer and sets _launcher
    assert _params(Strategy._configure_launcher) == ["self"]
    strategy = _trainer(strategy=HorovodStrategy(), devices=2).strategy
    assert isinstance(strategy.launcher, SubprocessScriptLauncher)
    assert (strategy.launcher.num_processes, strategy.launcher.num_nodes) == (2, 1)
    assert _trainer(strategy=HorovodStrategy()).strategy.launcher is None


def test_lightning_accelerator_connector_choose_strategy(no_launcher: None) -> None:
    from pytorch_lightning.strategies import SingleDeviceStrategy

    from hvd_trainer.lightning._compat import AcceleratorConnector

    # lightning/porting.py wraps _choose_strategy(self); the Trainer calls it for strategy="auto"
    assert _params(AcceleratorConnector._choose_strategy) == ["self"]
    assert AcceleratorConnector._choose_strategy._hvd_trainer_auto_horovod is True
    # ... and __init__, reading .strategy once it returns (a single-device strategy is named)
    assert AcceleratorConnector.__init__._hvd_trainer_auto_horovod is True
    assert isinstance(_trainer().strategy, SingleDeviceStrategy)
    assert isinstance(_trainer()._accelerator_connector.strategy, SingleDeviceStrategy)


def test_lightning_parallel_strategy_layer_sync(no_launcher: None) -> None:
    from pytorch_lightning.plugins import TorchSyncBatchNorm

    from hvd_trainer.strategy import HorovodStrategy

    assert HorovodStrategy()._layer_sync is None
    strategy = _trainer(strategy=HorovodStrategy(), sync_batchnorm=True).strategy
    assert isinstance(strategy._layer_sync, TorchSyncBatchNorm)


def test_lightning_fabric_optimizers_to_device() -> None:
    from lightning_fabric.utilities.optimizer import _optimizers_to_device

    from hvd_trainer.lightning._compat import optimizers_to_device

    assert optimizers_to_device is _optimizers_to_device
    assert _params(_optimizers_to_device) == ["optimizers", "device"]
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([w])
    w.grad = torch.ones(2)
    opt.step()
    optimizers_to_device([opt], torch.device("cpu"))
    assert opt.state[w]["exp_avg"].device.type == "cpu"


def test_lightning_all_gather_with_grads(world_of_one: hvd.World) -> None:
    """Replaced private: lightning_fabric's _all_gather_ddp_if_available (the strategy calls
    torch.distributed.nn.functional.all_gather, which it wrapped)."""
    from hvd_trainer.strategy import HorovodStrategy

    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    gathered = HorovodStrategy().all_gather(x.t() * 2, sync_grads=True)  # not contiguous
    assert gathered.shape == (1, 3, 2) and torch.equal(gathered[0], x.detach().t() * 2)
    gathered.sum().backward()
    assert x.grad is not None and x.grad.tolist() == [[2.0] * 3] * 2


SECOND_WORLD_ALL_GATHER = """
import torch, torch.distributed.nn.functional  # imported while the first world is current
import hvd_trainer as hvd
from hvd_trainer.strategy import HorovodStrategy
hvd.shutdown()
hvd.init()  # a second world (as after a re-form)
x = torch.ones(2, requires_grad=True)
HorovodStrategy().all_gather(x, sync_grads=True).sum().backward()
print(x.grad.tolist())
"""


def test_lightning_all_gather_with_grads_in_a_second_world(no_launcher: None) -> None:
    """torch.distributed.nn.functional.all_gather binds group.WORLD when first imported; the
    strategy passes the current world's group, so a re-formed world's backward does not reach the
    destroyed one ("not initialized in the world group map")."""
    code = "import hvd_trainer as hvd; hvd.init()\n" + SECOND_WORLD_ALL_GATHER
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "[1.0, 1.0]"


def test_lightning_module_trainer_when_detached(no_launcher: None) -> None:
    """Replaced private: LightningModule._trainer (public LightningModule.trainer raises)."""
    from hvd_trainer.lightning._compat import attached_trainer

    module = _tiny_module()
    assert attached_trainer(None) is None
    assert attached_trainer(module) is None
    trainer = _trainer(max_steps=1)
    trainer.fit(module)
    assert attached_trainer(module) is trainer


def test_lightning_checkpoint_connector(no_launcher: None, tmp_path: Path) -> None:
    """trainer._checkpoint_connector: dump_checkpoint, _loaded_checkpoint and
    _restore_modules_and_callbacks, as the elastic resume uses them."""
    import pytorch_lightning as pl
    from pytorch_lightning.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from hvd_trainer.lightning import _compat

    assert _params(_CheckpointConnector._restore_modules_and_callbacks)[:2] == ["self", "checkpoint_path"]
    assert "weights_only" in _params(_CheckpointConnector.dump_checkpoint)
    first = _trainer(max_steps=1)
    first.fit(_tiny_module())
    checkpoint = _compat.dump_checkpoint(first)
    for key in ("state_dict", "loops", "optimizer_states", "global_step", "callbacks"):
        assert key in checkpoint, key
    path = tmp_path / "commit.ckpt"
    torch.save(checkpoint, path)
    seen: dict[str, Any] = {}

    class RestoreAtFitStart(pl.Callback):  # where the elastic strategy restores: before training
        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen["before"] = _compat.has_loaded_checkpoint(trainer)
            _compat.restore_modules_and_callbacks(trainer, path)
            seen["after"] = _compat.has_loaded_checkpoint(trainer)
            seen["weight"] = pl_module.layer.weight.detach().clone()

    second = _trainer(max_steps=1, callbacks=[RestoreAtFitStart()])
    module = _tiny_module()
    second.fit(module)
    assert (seen["before"], seen["after"]) == (False, True)
    assert torch.equal(seen["weight"], checkpoint["state_dict"]["layer.weight"])
    assert second.global_step == 1  # Lightning restored the loops from the same loaded checkpoint


# -- Keras and TensorFlow (one subprocess) ------------------------------------------------------
_KERAS_CHECKS = textwrap.dedent(
    """
    import json, os, sys, tempfile, traceback
    import numpy as np
    import keras
    from hvd_trainer.keras import _compat

    results = {}

    def check(fn):
        try:
            fn()
            results[fn.__name__] = "ok"
        except Exception:
            results[fn.__name__] = traceback.format_exc()
        return fn

    @check
    def keras_optimizer_iterations():
        plain = keras.optimizers.SGD(0.1)
        v = keras.Variable(np.ones(2, "float32"))
        plain.build([v])
        assert _compat.iterations_variable(plain) is plain.iterations
        accumulating = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
        accumulating.build([v])
        counter = _compat.iterations_variable(accumulating)
        assert isinstance(counter, keras.Variable), type(counter)
        counter.assign_add(3)
        assert int(keras.ops.convert_to_numpy(accumulating.iterations)) == 1  # 3 // 2

    @check
    def keras_optimizer_trainable_variables():
        opt = keras.optimizers.Adam(0.1)
        vs = [keras.Variable(np.ones(2, "float32")), keras.Variable(np.ones(3, "float32"))]
        opt.build(vs)
        built = list(_compat.built_trainable_variables(opt))
        assert len(built) == 2 and all(a is b for a, b in zip(built, vs)), built

    @check
    def keras_model_checkpoint_saves_only_from_its_two_hooks():
        class Skipping(keras.callbacks.ModelCheckpoint):
            def on_train_batch_end(self, batch, logs=None):
                pass

            def on_epoch_end(self, epoch, logs=None):
                pass

        x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        with tempfile.TemporaryDirectory() as tmp:
            for freq in ("epoch", 1):
                for cls in (keras.callbacks.ModelCheckpoint, Skipping):
                    path = os.path.join(tmp, f"{cls.__name__}_{freq}.keras")
                    cb = cls(path, monitor="loss", save_freq=freq)
                    model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[cb])
                    assert os.path.exists(path) is (cls is keras.callbacks.ModelCheckpoint), (cls, freq)

    @check
    def tensorflow_graph_or_parents_in_xla_context():
        import inspect
        import tensorflow as tf
        from tensorflow.python.ops import control_flow_util

        assert list(inspect.signature(control_flow_util.GraphOrParentsInXlaContext).parameters) == ["graph"]
        seen = {}

        @tf.function(jit_compile=True)
        def compiled(x):
            seen["xla"] = _compat.in_xla_context()
            return x

        @tf.function
        def traced(x):
            seen["graph"] = _compat.in_xla_context()
            return x

        compiled(tf.constant(1.0))
        traced(tf.constant(1.0))
        assert seen == {"xla": True, "graph": False}, seen
        assert _compat.in_xla_context() is False

    print("RESULTS " + json.dumps(results))
    """
)
KERAS_CHECKS = ("keras_optimizer_iterations", "keras_optimizer_trainable_variables",
                "keras_model_checkpoint_saves_only_from_its_two_hooks",
                "tensorflow_graph_or_parents_in_xla_context")


@pytest.fixture(scope="module")
def keras_results() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KERAS_BACKEND": "torch", "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, "-c", _KERAS_CHECKS], capture_output=True, text=True,
                          timeout=240, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"exit code {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("name", KERAS_CHECKS)
def test_keras_and_tensorflow(name: str, keras_results: dict[str, str]) -> None:
    assert keras_results.get(name) == "ok", keras_results.get(name, f"{name} did not run")


def test_lightning_signal_connector_sigterm_notifier(no_launcher: None) -> None:
    import signal

    from pytorch_lightning.trainer.connectors.signal_connector import _SignalConnector

    from hvd_trainer.lightning._compat import replace_sigterm_notifier

    # lightning/signals.py: register_signal_handlers() reads self._sigterm_notifier_fn (so an
    # instance attribute set before it wins) and the loops read connector.received_sigterm
    assert callable(_SignalConnector._sigterm_notifier_fn)
    trainer = _trainer()
    calls: list[int] = []
    replace_sigterm_notifier(trainer, lambda signum, frame, connector: calls.append(signum))
    before = signal.getsignal(signal.SIGTERM)
    try:
        # an earlier test in this process may have left another library's SIGTERM handler
        # (ray.init installs one that calls sys.exit); Lightning chains to it, so start clean
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        trainer._signal_connector.register_signal_handlers()
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert calls == [signal.SIGTERM] and trainer.received_sigterm is False


def test_lightning_launcher_runs_fit_again_after_teardown(no_launcher: None) -> None:
    """``Strategy.launcher.launch(trainer_fn, *args, trainer=...)`` is how Lightning runs ``fit``
    (``trainer.call._call_and_handle_interrupt``), and the same ``trainer_fn`` runs again after
    ``Trainer._teardown()`` released a failed run (lightning/elastic.py's in-process recovery)."""
    import pytorch_lightning as pl
    from pytorch_lightning.trainer.states import TrainerStatus

    from hvd_trainer.lightning._compat import teardown_failed_run

    assert _params(pl.Trainer._teardown) == ["self"]
    runs: list[str] = []

    class Lost(RuntimeError):
        pass

    class LoseOnce(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if len(runs) == 1:
                raise Lost("a peer was lost")

    class AgainOnce:
        is_interactive_compatible = True

        def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
            runs.append(function.__name__)
            try:
                return function(*args, **kwargs)
            except Lost:
                teardown_failed_run(trainer)
                assert trainer.state.stage is None
                trainer.state.status, trainer.training = TrainerStatus.RUNNING, True
                runs.append(function.__name__)
                return function(*args, **kwargs)

        def kill(self, signum: int) -> None:
            pass

    trainer = _trainer(max_steps=2, callbacks=[LoseOnce()])
    trainer.strategy._launcher = AgainOnce()
    trainer.fit(_tiny_module())
    assert runs == ["_fit_impl", "_fit_impl"] and trainer.state.finished and trainer.global_step == 2

"""Code ported from ``import horovod.torch as hvd`` finds every common Horovod name, and the
single-process facts behind them (build info, Adasum errors, init arguments, timeline control)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
import torch

import hvd_trainer as hvd
from hvd_trainer.comm.base.config import CommConfig
from hvd_trainer.comm.world.build_info import MPINotEnabledError

HOROVOD_TORCH_NAMES = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline",
    "stop_timeline", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "allgather",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "sparse_allreduce_async", "poll", "synchronize", "join", "barrier", "broadcast_object",
    "allgather_object", "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
    "SyncBatchNorm", "Compression", "Average", "Sum", "Min", "Max", "Product", "Adasum", "ProcessSet",
    "add_process_set", "remove_process_set", "global_process_set", "elastic", "HorovodInternalError",
    "HostsUpdatedInterrupt",
]


def test_every_horovod_torch_name_exists_and_is_exported() -> None:
    missing = [name for name in HOROVOD_TORCH_NAMES if not hasattr(hvd, name)]
    assert not missing, f"missing from hvd_trainer: {missing}"
    assert not [name for name in HOROVOD_TORCH_NAMES if name not in hvd.__all__]
    assert not [name for name in hvd.__all__ if not hasattr(hvd, name)]
    assert callable(hvd.elastic.run) and hvd.elastic.TorchState is not None


def test_import_stays_light_and_elastic_needs_no_lightning() -> None:
    # hvd.elastic is imported with the package since it no longer pulls in Lightning (the
    # Lightning CheckpointIO moved to hvd_trainer.lightning.checkpoint_io).
    code = (
        "import sys, hvd_trainer as hvd\n"
        "heavy = ('lightning', 'lightning_fabric', 'pytorch_lightning', 'keras', 'tensorflow',\n"
        "         'mpi4py')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "hvd.elastic.run, hvd.elastic.TorchState, hvd.elastic.ElasticSampler\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["[]", "[]"], done.stdout


def test_build_info_matches_the_installed_torch() -> None:
    assert hvd.gloo_built() is torch.distributed.is_gloo_available()
    assert hvd.cuda_built() is (torch.version.cuda is not None)
    assert hvd.rocm_built() is (getattr(torch.version, "hip", None) is not None)
    nccl = torch.version.cuda is not None and torch.distributed.is_nccl_available()
    assert bool(hvd.nccl_built()) == nccl
    assert hvd.ddl_built() is False and hvd.ccl_built() is False
    assert hvd.mpi_enabled() is False and hvd.gloo_enabled() is False  # not launched, not initialised
    with pytest.raises(MPINotEnabledError, match="HINT"):
        hvd.mpi_threads_supported()
    assert isinstance(hvd.mpi_built(), bool)


def test_adasum_is_named_and_refused_where_it_does_not_run() -> None:
    # Adasum runs in allreduce / grouped_allreduce / DistributedOptimizer (tests/dist/test_adasum.py);
    # the collectives that cannot run it say so with a hint, as Horovod's errors do.
    with pytest.raises(NotImplementedError, match=r"Adasum.*HINT: Adasum runs in hvd.allreduce") as info:
        hvd.reducescatter(torch.ones(2), op=hvd.Adasum)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="Adasum"):
        hvd.grouped_reducescatter([torch.ones(2)], op="adasum")


def test_exceptions_for_ported_except_clauses() -> None:
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    interrupt = hvd.HostsUpdatedInterrupt(skip_sync=True)
    assert isinstance(interrupt, RuntimeError) and interrupt.skip_sync is True
    # a collective that fails because a peer died raises RankFailedError, which ported
    # `except hvd.HorovodInternalError:` clauses catch (tests/unit/test_liveness.py, tests/e2e)
    assert issubclass(hvd.RankFailedError, hvd.HorovodInternalError)


def test_timeline_dynamic_means_no_file_until_start() -> None:
    assert CommConfig.from_env({"HOROVOD_TIMELINE": "DYNAMIC"}).timeline_path is None
    assert CommConfig.from_env({"HOROVOD_TIMELINE": "/tmp/x.json"}).timeline_path == "/tmp/x.json"


def test_world_of_one_init_arguments_and_timeline_restart(tmp_path) -> None:
    with pytest.raises(hvd.NotInitializedError):
        hvd.start_timeline(str(tmp_path / "t.json"))
    with pytest.raises(ValueError, match="all 1 launched"):
        hvd.init(comm=[0, 1])
    world = hvd.init(comm=[0], process_sets="dynamic")
    try:
        assert world.size == 1 and hvd.is_homogeneous() is True and hvd.gloo_enabled() is True
        with pytest.raises(ValueError, match="already has these ranks"):  # [0] is the whole job
            hvd.add_process_set([0])
        with pytest.raises(TypeError, match="not a ProcessSet"):
            hvd.init(process_sets=[[0]])
        first, second = tmp_path / "first.json", tmp_path / "second.json"
        hvd.start_timeline(str(first))
        hvd.allreduce(torch.ones(1), name="one")
        hvd.start_timeline(str(second))  # closes the first
        hvd.allreduce(torch.ones(1), name="two")
        hvd.stop_timeline()
        names = {
            path.name: {e["args"]["tensor"] for e in json.loads(path.read_text())["traceEvents"]
                        if e.get("ph") == "X"}
            for path in (first, second)
        }
        assert names == {"first.json": {"one"}, "second.json": {"two"}}
        with pytest.warns(UserWarning, match="mark_cycles"):
            hvd.start_timeline(str(first), mark_cycles=True)
        hvd.stop_timeline()
        assert json.loads(first.read_text())["traceEvents"] == []  # restarted: nothing recorded
    finally:
        hvd.shutdown()


def test_world_of_one_async_forms_on_the_default_backend(tmp_path) -> None:
    """On a CUDA machine init() picks NCCL and these run on the GPU; here they run on gloo."""
    world = hvd.init()
    try:
        x = torch.arange(6.0, device=world.device).reshape(3, 2)
        assert hvd.synchronize(hvd.allgather_async(x)).tolist() == x.tolist()
        b = x.clone()
        assert hvd.synchronize(hvd.broadcast_async_(b, 0)) is b and b.tolist() == x.tolist()
        assert hvd.synchronize(hvd.broadcast_async(x, 0)).device == x.device
        assert hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum)).tolist() == x.tolist()
        out, received = hvd.synchronize(hvd.alltoall_async(x))
        assert out.tolist() == x.tolist() and received.tolist() == [3]
        grouped = hvd.grouped_reducescatter([x, x.long()], op=hvd.Sum)
        assert [t.tolist() for t in grouped] == [x.tolist(), x.long().tolist()]
        assert grouped[0].device == x.device
        assert hvd.grouped_allgather([x, x[:1]])[1].tolist() == x[:1].tolist()
        sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,),
                                         check_invariants=True)
        assert hvd.sparse_allreduce_async(sparse.to(world.device))().to_dense().tolist() == [1, 0, 2, 0]
        path = tmp_path / "tl.json"
        hvd.start_timeline(str(path))
        hvd.allreduce(x, name="dev_tensor")
        hvd.synchronize(hvd.allgather_async(x, name="dev_gather"))
        hvd.stop_timeline()
        events = json.loads(path.read_text())["traceEvents"]
        assert {"dev_tensor", "dev_gather"} <= {e["args"]["tensor"] for e in events if e.get("ph") == "X"}
        assert hvd.gloo_enabled() is (world.backend == "gloo")
    finally:
        hvd.shutdown()


def test_average_keyword_and_positional_bool_as_in_horovod() -> None:
    from hvd_trainer.comm.ops.ops import ReduceOp, op_or_average, to_reduce_op

    assert to_reduce_op(True) is ReduceOp.AVERAGE and to_reduce_op(False) is ReduceOp.SUM
    with pytest.warns(DeprecationWarning, match="use op=hvd.Average"):
        assert op_or_average(None, True) is ReduceOp.AVERAGE
    with pytest.warns(DeprecationWarning, match="use op=hvd.Sum"):
        assert op_or_average(None, False) is ReduceOp.SUM
    assert op_or_average("sum", None) == "sum"
    with pytest.raises(ValueError, match="both average=True and op="):
        op_or_average(hvd.Sum, True)
    for fn in (hvd.allreduce, hvd.allreduce_, hvd.allreduce_async, hvd.allreduce_async_,
               hvd.grouped_allreduce_async):
        assert "average" in inspect.signature(fn).parameters, fn.__name__


def test_hvd_trainer_torch_offers_every_name_of_hvd_trainer() -> None:
    # `import hvd_trainer.torch as hvd` and `import hvd_trainer as hvd` are the same API.
    import hvd_trainer.torch as hvd_torch

    names = [n for n in hvd.__all__ if n != "__version__"]
    assert sorted(names) == sorted(hvd_torch.__all__)
    assert not [n for n in names if getattr(hvd_torch, n) is not getattr(hvd, n)]
    assert not [n for n in HOROVOD_TORCH_NAMES if not hasattr(hvd_torch, n)]

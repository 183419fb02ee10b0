"""Horovod's signatures, positionally too (issue 11, class 3).

A table of Horovod's torch API (``horovod/torch/mpi_ops.py``, ``functions.py``,
``optimizer.py``), written out here: for every function, the parameters a caller may pass
positionally, in order, with their defaults. Ours must have exactly those first (same names,
order and defaults); anything we add must be keyword-only. Two deliberate differences: the
default ``process_set`` is ``None`` (meaning Horovod's ``global_process_set``; both are
accepted), and ``root_rank`` defaults to 0 where Horovod has no default (a superset: every
Horovod call still binds the same way).
"""

from __future__ import annotations

import inspect

import pytest

import hvd_trainer.torch as hvd
from hvd_trainer.comm import Average, Compression

REQUIRED = inspect.Parameter.empty
GLOBAL = "global_process_set"

PRE_POST = [("prescale_factor", 1.0), ("postscale_factor", 1.0)]
ASYNC_AR = [("average", None), ("name", None), ("op", None), *PRE_POST, ("process_set", GLOBAL)]
BLOCKING_AR = [("average", None), ("name", None), ("compression", Compression.none), ("op", None),
               *PRE_POST, ("process_set", GLOBAL)]
ASYNC_RS = [("name", None), ("op", Average), ("process_set", GLOBAL), *PRE_POST]
BLOCKING_RS = [("name", None), ("compression", Compression.none), ("op", Average),
               ("process_set", GLOBAL), *PRE_POST]
GATHER = [("name", None), ("process_set", GLOBAL)]
BCAST = [("root_rank", REQUIRED), ("name", None), ("process_set", GLOBAL)]
A2A = [("splits", None), ("name", None), ("process_set", GLOBAL)]

HOROVOD = {
    "allreduce_async": [("tensor", REQUIRED), *ASYNC_AR],
    "allreduce_async_": [("tensor", REQUIRED), *ASYNC_AR],
    "allreduce_": [("tensor", REQUIRED), *ASYNC_AR],
    "allreduce": [("tensor", REQUIRED), *BLOCKING_AR],
    "grouped_allreduce_async": [("tensors", REQUIRED), *ASYNC_AR],
    "grouped_allreduce_async_": [("tensors", REQUIRED), *ASYNC_AR],
    "grouped_allreduce_": [("tensors", REQUIRED), *ASYNC_AR],
    "grouped_allreduce": [("tensors", REQUIRED), *BLOCKING_AR],
    "allgather_async": [("tensor", REQUIRED), *GATHER],
    "allgather": [("tensor", REQUIRED), *GATHER],
    "grouped_allgather_async": [("tensors", REQUIRED), *GATHER],
    "grouped_allgather": [("tensors", REQUIRED), *GATHER],
    "broadcast_async": [("tensor", REQUIRED), *BCAST],
    "broadcast_async_": [("tensor", REQUIRED), *BCAST],
    "broadcast": [("tensor", REQUIRED), *BCAST],
    "broadcast_": [("tensor", REQUIRED), *BCAST],
    "alltoall_async": [("tensor", REQUIRED), *A2A],
    "alltoall": [("tensor", REQUIRED), *A2A],
    "reducescatter_async": [("tensor", REQUIRED), *ASYNC_RS],
    "reducescatter": [("tensor", REQUIRED), *BLOCKING_RS],
    "grouped_reducescatter_async": [("tensors", REQUIRED), *ASYNC_RS],
    "grouped_reducescatter": [("tensors", REQUIRED), *BLOCKING_RS],
    "poll": [("handle", REQUIRED)],
    "synchronize": [("handle", REQUIRED)],
    "join": [("device", -1)],
    "barrier": [("process_set", GLOBAL)],
    "broadcast_object": [("obj", REQUIRED), ("root_rank", 0), ("name", None), ("process_set", GLOBAL)],
    "allgather_object": [("obj", REQUIRED), ("name", None), ("process_set", GLOBAL)],
    "broadcast_parameters": [("params", REQUIRED), ("root_rank", REQUIRED)],
    "broadcast_optimizer_state": [("optimizer", REQUIRED), ("root_rank", REQUIRED), ("model", None)],
    "DistributedOptimizer": [
        ("optimizer", REQUIRED), ("named_parameters", None), ("compression", Compression.none),
        ("backward_passes_per_step", 1), ("op", Average), ("gradient_predivide_factor", 1.0),
        ("num_groups", 0), ("groups", None), ("sparse_as_dense", False), ("process_set", GLOBAL),
    ],
    "sparse_allreduce_async": [("tensor", REQUIRED), ("name", REQUIRED), ("op", REQUIRED),
                               ("process_set", GLOBAL)],
}

# where we give a default Horovod lacks (a superset: a Horovod call binds the same way)
EXTRA_DEFAULTS = {("broadcast_parameters", "root_rank"), ("broadcast_optimizer_state", "root_rank"),
                  ("sparse_allreduce_async", "name"), ("sparse_allreduce_async", "op")}


def _positional(fn) -> list[inspect.Parameter]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    target = fn.__init__ if inspect.isclass(fn) else fn
    params = list(inspect.signature(target).parameters.values())
    if inspect.isclass(fn):
        params = params[1:]  # self
    return [p for p in params if p.kind in kinds]


@pytest.mark.parametrize("name", sorted(HOROVOD))
def test_positional_parameters_are_horovods(name: str) -> None:
    ours = _positional(getattr(hvd, name))
    theirs = HOROVOD[name]
    assert [p.name for p in ours] == [n for n, _ in theirs], name  # names and order; extras kw-only
    for p, (pname, default) in zip(ours, theirs, strict=True):
        if default == GLOBAL:
            assert p.default is None or p.default is hvd.global_process_set, (name, pname)
        elif default is REQUIRED and (name, pname) in EXTRA_DEFAULTS:
            continue
        else:
            assert p.default == default, (name, pname, p.default, default)


def test_the_same_names_from_every_import_path() -> None:
    import hvd_trainer
    from hvd_trainer.torch import compression, functions, mpi_ops

    for name in HOROVOD:
        assert getattr(hvd_trainer, name) is getattr(hvd, name), name
    for name in set(HOROVOD) - {"DistributedOptimizer", "broadcast_parameters",
                                "broadcast_optimizer_state", "sparse_allreduce_async",
                                "broadcast_object", "allgather_object"}:
        assert getattr(mpi_ops, name) is getattr(hvd, name), name
    for name in ("broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
                 "allgather_object"):
        assert getattr(functions, name) is getattr(hvd, name), name
    assert compression.Compression is hvd.Compression and compression.FP16Compressor
    assert hvd.elastic.run is hvd_trainer.elastic.run and hvd.elastic.TorchState


def test_horovods_positional_calls_bind_as_in_horovod() -> None:
    bound = inspect.signature(hvd.allreduce_).bind(None, None, "name", hvd.Sum)
    assert bound.arguments == {"tensor": None, "average": None, "name": "name", "op": hvd.Sum}
    bound = inspect.signature(hvd.allreduce).bind(None, None, "n", Compression.fp16, hvd.Sum, 2.0)
    assert bound.arguments["compression"] is Compression.fp16 and bound.arguments["prescale_factor"] == 2.0
    bound = inspect.signature(hvd.reducescatter).bind(None, "n", Compression.none, hvd.Sum)
    assert bound.arguments["op"] is hvd.Sum
    bound = inspect.signature(hvd.join).bind(0)
    assert bound.arguments == {"device": 0}

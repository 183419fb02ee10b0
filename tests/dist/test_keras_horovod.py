"""Horovod's Keras API on 2 processes over gloo, once per backend (each worker runs
tests/dist/_keras_horovod_suite.py::suite): BroadcastGlobalVariablesCallback(local_variables=),
DistributedOptimizer.from_config and Horovod's argument order, PartialDistributedOptimizer /
register_local_var, process_set=, sparse_as_dense, KerasState.sync with an unbuilt optimizer and
hvd_trainer.keras.elastic's callbacks."""

from __future__ import annotations

import numpy as np
import pytest

from tests.dist import _keras_horovod_suite as suite
from tests.multiproc import run_workers

BACKENDS = ["torch", "tensorflow"]
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module", params=BACKENDS)
def results(request):
    backend = request.param
    out = run_workers(suite.suite, 2, args=(backend,), env={"KERAS_BACKEND": backend, **QUIET},
                      timeout_seconds=240)
    return backend, out


def _close(a, b, tol=0.0) -> bool:
    return all(np.allclose(np.asarray(x), np.asarray(y), rtol=0, atol=tol) for x, y in zip(a, b, strict=True))


def test_broadcast_leaves_local_variables_alone(results):
    _, (r0, r1) = results
    a, b = r0["bcast_local"], r1["bcast_local"]
    assert not _close(a["init"]["body"], b["init"]["body"])  # different init per rank
    assert _close(a["body"], a["init"]["body"]) and _close(b["body"], a["init"]["body"])  # rank 0's
    assert _close(a["head"], a["init"]["head"]) and _close(b["head"], b["init"]["head"])  # own values
    assert not _close(a["head"], b["head"])
    assert "keras.Variable" in a["bad"] and "HINT" in a["bad"]


def test_from_config_round_trip_and_positional_order(results):
    _, (r0, r1) = results
    for r in (r0, r1):
        fc = r["from_config"]
        assert fc["copy_type"] == "DistributedOptimizer" and fc["copy_cfg_equal"]
        assert fc["copy_options"] == [2, "FP16Compressor", 2.0]
        assert fc["class_copy_cfg_equal"] and fc["class_copy_type"] == "Adam"
        assert fc["served"] == ["DistributedOptimizer", 0.25]
        assert "serialize" in fc["bare_error"] and "HINT" in fc["bare_error"]
        assert fc["positional_compression"] == "FP16Compressor"
        assert fc["lr_positional"] == [2, 7, False, 7, 3]
        assert fc["iterations"] == 4
    assert _close(r0["from_config"]["trained"], r1["from_config"]["trained"])


def test_partial_optimizer_keeps_local_gradients_local(results):
    _, (r0, r1) = results
    for name in ("scaled", "unscaled", "accumulated"):
        a, b = r0["partial"][name], r1["partial"][name]
        assert a["local"] == 2  # the head's kernel and bias
        assert _close(a["body"], b["body"])  # averaged: identical on both ranks
        assert not _close(a["body"], a["ref_body"], tol=1e-6)  # ... and not rank 0's alone
        for r in (a, b):  # the head moved by this rank's own gradient (/ size when scaled)
            assert _close(r["head"], r["ref_head"], tol=1e-6), name
        assert not _close(a["head"], b["head"], tol=1e-4)
    assert "keras.layers.Layer" in r0["partial"]["bad"]


def test_process_set_reduces_over_its_members_only(results):
    _, (r0, r1) = results
    a, b = r0["psets"], r1["psets"]
    assert _close(a["both"], a["default"], tol=1e-6) and _close(b["both"], a["default"], tol=1e-6)
    assert _close(a["both_predivide"], a["default"], tol=1e-6)
    assert not _close(a["default"], a["alone"], tol=1e-4)  # averaging changed the step
    for r in (a, b):
        assert _close(r["only0"], r["alone"], tol=1e-6)  # member of a 1-rank set, or outside it
        assert _close(r["added1"], r["alone"], tol=1e-6)  # hvd.add_process_set([1])
        assert _close(r["global"], a["default"], tol=1e-6)  # hvd.global_process_set
        assert r["global_set"] == [0, [0, 1]] and r["removed"] == [True, None]
        assert r["ids_and_ranks"] == {0: [0, 1], 1: [0, 1], 2: [0], 3: [1]}, r["ids_and_ranks"]


def test_sparse_as_dense_both_ways_match_one_process(results):
    _, out = results
    for r in out:
        s = r["sparse"]
        assert not _close(s["ref"], s["init"], tol=1e-3)  # training moved the embedding
        assert _close(s["True"], s["ref"], tol=1e-6)
        assert _close(s["False"], s["ref"], tol=1e-6)


def test_keras_state_sync_with_unbuilt_optimizer(results):
    _, (r0, r1) = results
    for case in ("root_fresh", "all_fresh"):
        a, b = r0["sync"][case], r1["sync"][case]
        assert a["n_opt"] == b["n_opt"] == 2 + 2 * 4  # iterations, lr, Adam's m and v for 4 weights
        assert _close(a["weights"], a["init0"]) and _close(b["weights"], a["init0"])
        assert _close(a["opt"], b["opt"])
        assert b["opt"][0] == 0  # rank 0's fresh iterations reached the trained rank
        assert a["epoch"] == b["epoch"] == 0
        assert a["has_backend_attr"] is False


def test_elastic_callbacks_commit_and_track_progress(results):
    _, (r0, r1) = results
    for r in (r0, r1):
        e = r["elastic"]
        assert e["same_objects"] == [True, True]
        # 2 epochs x 4 batches, commit after batches 3 and 6 (counted across epochs) and at
        # each epoch end; run()'s sync at the start counts as none
        assert e["result"] == [2, 0, 4]
        batches = [(b, c) for kind, b, c in e["seen"] if kind == "batch"]
        assert batches == [(0, 0), (1, 0), (2, 1), (3, 1), (0, 2), (1, 3), (2, 3), (3, 3)]
        assert [s for kind, _, s in e["seen"] if kind == "steps"] == [4, 4]
        assert e["short"] == [2, 4]  # first epoch after a mid-epoch restart is shortened
        assert "batches_per_commit=0" in e["bad"]

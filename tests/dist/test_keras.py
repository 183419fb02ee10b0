"""hvd_trainer.keras on 2 processes over gloo, once per backend (each worker runs
tests/dist/_keras_suite.py::suite), plus loading the saved model in a process without
hvd_trainer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.dist import _keras_suite as suite
from tests.multiproc import run_workers

BACKENDS = ["torch", "tensorflow"]
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module", params=BACKENDS)
def results(request, tmp_path_factory):
    backend = request.param
    path = str(tmp_path_factory.mktemp(backend) / "model.keras")
    out = run_workers(suite.suite, 2, args=(backend, path),
                      env={"KERAS_BACKEND": backend, **QUIET}, timeout_seconds=240)
    return backend, path, out


def _close(a, b, tol=0.0) -> bool:
    return all(np.allclose(np.asarray(x), np.asarray(y), rtol=0, atol=tol) for x, y in zip(a, b, strict=True))


def test_broadcast_then_identical_weights(results):
    _, _, (r0, r1) = results
    assert _close(r0["broadcast"]["first"], r1["broadcast"]["first"])  # before the first update
    assert _close(r0["broadcast"]["final"], r1["broadcast"]["final"])
    assert _close(r0["broadcast"]["opt_vars"], r1["broadcast"]["opt_vars"])


def test_two_ranks_equal_one_process_double_batch(results):
    _, _, out = results
    for r in out:
        assert r["equiv"]["moved"] > 1e-2  # training changed the weights
        assert r["equiv"]["max_abs_diff"] < 1e-5


def _expected_warmup():
    # lr = 0.4/2 * ((e + b/4) * (2-1)/2 + 1) during warmup (2 epochs), then 0.4.
    table = []
    for e in range(3):
        for b in range(suite.STEPS):
            t = e + b / suite.STEPS
            table.append((e, b, 0.4 if t >= 2 else 0.2 * (t / 2 + 1)))
    return table


def _check_table(got, expected):
    assert [(e, b) for e, b, _ in got] == [(e, b) for e, b, _ in expected]
    np.testing.assert_allclose([v for *_, v in got], [v for *_, v in expected], rtol=1e-6)


def test_lr_callbacks_closed_form(results):
    _, _, out = results
    for r in out:
        lr = r["lr"]
        _check_table(lr["warmup"], _expected_warmup())
        # end of epoch 0: the value of its last batch, 0.2 * (0.75 / 2 + 1); then 0.4 exactly
        np.testing.assert_allclose(lr["warmup_logs_lr"], [0.275, 0.4, 0.4], rtol=1e-6)
        # float multiplier 0.5 over epochs [1, 4), Horovod's lr = 0.2 * 0.5 ** (epoch - 1):
        # 0.2 (untouched), 0.2 (factor 1 at start_epoch), 0.1, 0.05, then left at 0.05
        per_epoch = {0: 0.2, 1: 0.2, 2: 0.1, 3: 0.05, 4: 0.05}
        _check_table(lr["float"], [(e, b, per_epoch[e]) for e in range(5) for b in range(suite.STEPS)])
        _check_table(lr["float_resumed"], [(e, b, per_epoch[e]) for e in (2, 3, 4) for b in range(suite.STEPS)])
        # staircase=False: the float decays every batch at the fractional epoch
        _check_table(lr["float_smooth"], [(e, b, 0.2 * 0.5 ** (e + b / suite.STEPS))
                                          for e in range(2) for b in range(suite.STEPS)])
        _check_table(lr["func"], [(e, b, 0.2 / (1 + e + b / suite.STEPS))
                                  for e in range(2) for b in range(suite.STEPS)])


def test_metric_average_makes_early_stopping_agree(results):
    _, _, out = results
    n = len(suite.FAKE_CURVES[0])
    mean = [(a + b) / 2 for a, b in zip(suite.FAKE_CURVES[0], suite.FAKE_CURVES[1], strict=True)]
    for r in out:
        assert r["early"]["epochs"] == n  # rank 0 alone would have stopped after epoch 2
        np.testing.assert_allclose([lg["val_fake"] for lg in r["early"]["logs"]], mean, rtol=1e-12)
    for key in ("loss", "val_loss"):  # real metrics averaged too: identical on both ranks
        assert [lg[key] for lg in out[0]["early"]["logs"]] == [lg[key] for lg in out[1]["early"]["logs"]]


def test_metric_key_mismatch_is_an_error_on_every_rank(results):
    _, _, out = results
    for r in out:
        assert "rank 0: ['acc', 'loss']; rank 1: ['accuracy', 'loss']" in r["keys"]


def test_mixed_precision_inf_on_one_rank_skips_everywhere(results):
    _, _, (r0, r1) = results
    for r in (r0, r1):
        assert r["mixed"]["lso"] == "LossScaleOptimizer"
        skipped = suite.STEPS - r["mixed"]["iterations"]  # a skipped step applies nothing
        assert skipped >= 1  # the injected inf
        assert r["mixed"]["scale"] == 2.0**15 / 2**skipped  # halved once per skipped step
        assert r["mixed"]["finite"]
    assert r0["mixed"]["scale"] == r1["mixed"]["scale"]
    assert r0["mixed"]["iterations"] == r1["mixed"]["iterations"]
    assert _close(r0["mixed"]["weights"], r1["mixed"]["weights"])


def test_tf_lazily_built_optimizer_and_xla(results):
    backend, _, out = results
    if backend != "tensorflow":
        pytest.skip("lazy build and XLA are TensorFlow-backend behaviours")
    r0, r1 = out[0]["tf"], out[1]["tf"]
    assert _close(r0["lazy_first"], r1["lazy_first"])  # after batch 0 (broadcast fallback)
    assert _close(r0["lazy_final"], r1["lazy_final"])
    assert _close(r0["lazy_opt"], r1["lazy_opt"])
    assert r0["xla_warned"] and not r0["xla_jit"]
    assert _close(r0["xla_final"], r1["xla_final"])


def test_compression_and_predivide_variants(results):
    backend, _, (r0, r1) = results
    v0, v1 = r0["variants"], r1["variants"]
    wire = v0.pop("wire_bytes")
    assert wire == v1.pop("wire_bytes")
    for name in v0:
        assert _close(v0[name], v1[name])  # identical across ranks
    assert _close(v0["predivide"], v0["plain"], tol=1e-6)  # same maths, other rounding
    for plain, fp16 in (("plain", "fp16"), ("acc_plain", "acc_fp16")):
        assert _close(v0[fp16], v0[plain], tol=1e-2)  # fp16 wire: ~3 significant digits
        assert not _close(v0[fp16], v0[plain], tol=0.0)  # the compressor was really used
    assert not _close(v0["acc_plain"], v0["plain"], tol=1e-3)  # accumulation changed the run
    # wire bytes of 2 ranks, ring-counted: a reduction sends 2 (N-1)/N of its payload, the 43
    # gradient floats (on torch, with one "used" flag per variable: 4 more), in the wire dtype
    floats = 43 + (4 if backend == "torch" else 0)
    assert wire["plain"] == wire["predivide"] == suite.STEPS * floats * 4
    assert wire["fp16"] == suite.STEPS * floats * 2
    # accumulation: one reduction per window of 2 steps
    assert wire["acc_plain"] == suite.STEPS // 2 * floats * 4
    assert wire["acc_fp16"] == suite.STEPS // 2 * floats * 2


def test_adasum_combines_each_variables_gradients_by_their_dot_products(results):
    """Horovod's ``op=hvd.Adasum`` on the Keras optimizer, both backends (torch: the bucket
    hook; TensorFlow: a grouped Adasum), with and without accumulation."""
    _, _, (r0, r1) = results
    for name in ("step", "accumulated"):
        assert r0["adasum"][name] <= 1e-5 and r1["adasum"][name] <= 1e-5, (r0["adasum"], r1["adasum"])
        assert r0["adasum"][f"{name}_vs_average"] > 1e-3  # not the average: Adasum really ran
        assert _close(r0["adasum"][f"{name}_weights"], r1["adasum"][f"{name}_weights"])


def test_accumulation_equals_one_process_on_all_micro_batches(results):
    _, _, (r0, r1) = results
    for key in ("sum", "avg"):
        a0, a1 = r0["acc"][key], r1["acc"][key]
        assert [s["iterations"] for s in a0["steps"]] == [1, 2, 3, 4]  # every call counts
        for s0, s1 in zip(a0["steps"], a1["steps"], strict=True):
            assert _close(s0["weights"], s1["weights"])  # identical across ranks
        steps, ref = a0["steps"], a0["ref"]
        assert _close(steps[0]["weights"], a0["init"])  # accumulate pass: nothing applied
        assert _close(steps[1]["weights"], ref[0], tol=1e-5)
        assert _close(steps[2]["weights"], steps[1]["weights"])  # accumulators were zeroed ...
        assert _close(steps[3]["weights"], ref[1], tol=1e-5)  # ... so window 2 matches too
        assert not _close(ref[0], a0["init"], tol=1e-2)  # the update is visible at 1e-5
    # average_aggregated_gradients=True applies half the summed gradient
    assert not _close(r0["acc"]["sum"]["ref"][0], r0["acc"]["avg"]["ref"][0], tol=1e-3)


def test_accumulation_fit_with_leftover_batches(results):
    _, _, (r0, r1) = results
    for r in (r0, r1):
        assert r["acc_fit"]["iterations"] == 10  # 5 batches x 2 epochs, one per batch
        assert r["acc_fit"]["finite"]
    assert _close(r0["acc_fit"]["weights"], r1["acc_fit"]["weights"])


def test_argument_errors_echo_value(results):
    _, _, (r0, _) = results
    errors = r0["errors"]
    assert "op='max'" in errors["op"]
    assert "backward_passes_per_step=0" in errors["passes"] and "HINT" in errors["passes"]
    assert "compression='powersgd:0'" in errors["compression"] and "HINT" in errors["compression"]
    assert "backward_passes_per_step=True" in errors["passes_bool"] and "HINT" in errors["passes_bool"]
    assert "gradient_predivide_factor=0" in errors["predivide"]
    assert errors["kwarg"].startswith("TypeError") and "['lr']" in errors["kwarg"]
    assert errors["type"].startswith("TypeError") and "'sgd'" in errors["type"]
    assert "already a DistributedOptimizer" in errors["twice"]


_LOADER = textwrap.dedent("""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "hvd_trainer":
                raise ImportError("hvd_trainer is blocked in this process")
    sys.meta_path.insert(0, Block())
    import keras, numpy as np
    path = sys.argv[1]
    model = keras.saving.load_model(path)
    pred = model.predict(np.load(path + ".x.npy"), verbose=0)
    np.testing.assert_allclose(pred, np.load(path + ".pred.npy"), rtol=1e-5, atol=1e-6)
    assert not [m for m in sys.modules if m.startswith("hvd_trainer")]
    print("LOADED", type(model.optimizer).__name__, len(model.optimizer.variables),
          int(np.asarray(model.optimizer.iterations)))
""")


def test_saved_model_loads_without_hvd_trainer(results, tmp_path):
    # A fresh interpreter of its own (not run_workers): it must load with hvd_trainer never imported.
    backend, path, _ = results
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"KERAS_BACKEND": backend, **QUIET})
    proc = subprocess.run([sys.executable, "-c", _LOADER, path], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # Adam: iterations, learning_rate, 2 slots per variable (4 variables), no accumulators;
    # 4 batches of 8 rows with backward_passes_per_step=2: iterations counts every batch
    assert f"LOADED Adam 10 {suite.STEPS}" in proc.stdout, proc.stdout

"""Horovod's module-level Keras API (``import hvd_trainer.keras as hvd``) on 2 processes, once
per backend: allreduce / allgather / broadcast on Keras values (eager and, on TensorFlow, inside
``tf.function``), and ``load_model`` resuming a saved run with a DistributedOptimizer that
matches one process training on the global batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.multiproc import run_workers

BACKENDS = ["torch", "tensorflow"]
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"}
B = 4  # rows per rank per step


def _data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rs = np.random.RandomState(100 + rank)
    x = rs.randn(B, 3).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], dtype="float32")) + 0.1 * rank


def _collectives(hvd: Any, keras: Any) -> dict[str, Any]:
    r = hvd.rank()
    out: dict[str, Any] = {}
    value = keras.ops.convert_to_tensor(np.array([1.0, 2.0], dtype="float32") * (r + 1))
    out["avg"] = keras.ops.convert_to_numpy(hvd.allreduce(value)).tolist()
    out["sum"] = keras.ops.convert_to_numpy(hvd.allreduce(value, op=hvd.Sum)).tolist()
    out["avg_false"] = keras.ops.convert_to_numpy(hvd.allreduce(value, average=False)).tolist()
    out["max"] = keras.ops.convert_to_numpy(hvd.allreduce(value, op=hvd.Max)).tolist()
    out["int_sum"] = keras.ops.convert_to_numpy(hvd.allreduce(np.array([r + 1], dtype="int32"), op=hvd.Sum))
    out["int_sum"] = [out["int_sum"].tolist(), str(out["int_sum"].dtype)]
    out["scalar"] = float(hvd.allreduce(float(r)))
    out["fp16"] = keras.ops.convert_to_numpy(
        hvd.allreduce(np.array([1 / 3 + r], dtype="float32"), compression=hvd.Compression.fp16)
    ).tolist()
    # fp16 wire of values beyond fp16's range (65504): the comm path scales before the cast
    big = np.array([6.0e4, 1.0e5 * (r + 1), -7.0e4], dtype="float32")
    fp16 = hvd.Compression.fp16
    out["fp16_big_avg"] = keras.ops.convert_to_numpy(hvd.allreduce(big, compression=fp16)).tolist()
    out["fp16_big_sum"] = keras.ops.convert_to_numpy(hvd.allreduce(big, op=hvd.Sum, compression="fp16")).tolist()
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        traced_big = tf.function(lambda t: hvd.allreduce(t, compression=fp16))
        out["fp16_big_traced"] = traced_big(tf.constant(big)).numpy().tolist()
    rows = np.full((r + 1, 2), float(r), dtype="float32")
    out["gather"] = keras.ops.convert_to_numpy(hvd.allgather(rows)).tolist()
    out["bcast"] = keras.ops.convert_to_numpy(hvd.broadcast(np.array([r, 7 * r], dtype="int64"), 1)).tolist()
    try:
        hvd.allreduce(value, average=True, op=hvd.Sum)
        out["both_error"] = None
    except hvd.KerasCollectiveError as err:
        out["both_error"] = str(err)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        @tf.function
        def traced(t):
            g = hvd.allgather(t)
            return hvd.allreduce(t), g, g.shape.as_list()

        avg, gathered, static_shape = traced(tf.constant([[float(r), 1.0]]))
        out["traced"] = [avg.numpy().tolist(), gathered.numpy().tolist(), static_shape]
    return out


def _model(keras: Any, seed: int) -> Any:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])


def _load_model(hvd: Any, keras: Any, path: str) -> dict[str, Any]:
    from hvd_trainer.comm import barrier

    r = hvd.rank()
    if r == 0:  # a saved run: 2 steps of SGD with momentum on rank 0's data
        m = _model(keras, 3)
        m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
        m.fit(*_data(0), batch_size=B, epochs=2, verbose=0, shuffle=False)
        m.save(path)
    barrier()
    out: dict[str, Any] = {}
    try:
        hvd.load_model(path + ".missing")
    except FileNotFoundError as err:
        out["missing"] = str(err)
    model = hvd.load_model(path)
    out["wrapped"] = type(model.optimizer).__name__
    out["iterations_loaded"] = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    model.fit(*_data(r), batch_size=B, epochs=3, verbose=0, shuffle=False)
    out["iterations"] = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    out["weights"] = [w.tolist() for w in model.get_weights()]
    ref = keras.models.load_model(path)  # one process, the global batch of both ranks
    xs, ys = zip(*(_data(k) for k in range(hvd.size())), strict=True)
    ref.fit(np.concatenate(xs), np.concatenate(ys), batch_size=B * hvd.size(), epochs=3, verbose=0,
            shuffle=False)
    out["ref"] = [w.tolist() for w in ref.get_weights()]
    return out


def _worker(path: str) -> dict[str, Any]:
    import keras

    import hvd_trainer.keras as hvd

    return {"coll": _collectives(hvd, keras), "load": _load_model(hvd, keras, path)}


@pytest.fixture(scope="module", params=BACKENDS)
def results(request, tmp_path_factory) -> tuple[str, list[dict[str, Any]]]:
    backend = request.param
    path = str(tmp_path_factory.mktemp(backend) / "saved.keras")
    out = run_workers(_worker, 2, args=(path,), env={"KERAS_BACKEND": backend, **QUIET}, timeout_seconds=240)
    return backend, out


def test_collectives_on_keras_values(results) -> None:
    backend, out = results
    for r in out:
        c = r["coll"]
        assert c["avg"] == [1.5, 3.0]
        assert c["sum"] == c["avg_false"] == [3.0, 6.0]
        assert c["max"] == [2.0, 4.0]
        assert c["int_sum"] == [[3], "int32"]
        assert c["scalar"] == 0.5
        assert abs(c["fp16"][0] - (1 / 3 + 0.5)) < 1e-3
        big_keys = ["fp16_big_avg"] + (["fp16_big_traced"] if backend == "tensorflow" else [])
        for key, want in [*((k, [6.0e4, 1.5e5, -7.0e4]) for k in big_keys),
                          ("fp16_big_sum", [1.2e5, 3.0e5, -1.4e5])]:
            for got, w in zip(c[key], want, strict=True):  # finite, within fp16 rounding
                assert abs(got - w) <= 1e-3 * abs(w), (key, c[key], want)
        assert c["gather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]  # rank 0: 1 row, rank 1: 2 rows
        assert c["bcast"] == [1, 7]
        assert "average=True" in c["both_error"] and "op=" in c["both_error"]
        if backend == "tensorflow":
            assert c["traced"] == [[[0.5, 1.0]], [[0.0, 1.0], [1.0, 1.0]], [None, 2]]


def test_load_model_wraps_optimizer_and_resumes_as_one_process(results) -> None:
    _, out = results
    for r in out:
        lm = r["load"]
        assert "saved.keras.missing" in lm["missing"]
        assert lm["wrapped"] == "DistributedOptimizer"
        assert lm["iterations_loaded"] == 2 and lm["iterations"] == 5
        for got, want in zip(lm["weights"], lm["ref"], strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    for a, b in zip(out[0]["load"]["weights"], out[1]["load"]["weights"], strict=True):
        assert np.array_equal(a, b)

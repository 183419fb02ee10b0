"""Checks run inside each spawned worker of tests/dist/test_keras.py (one spawn per backend).

Every function returns plain Python data; the test process asserts on it.
"""

from __future__ import annotations

import warnings

import numpy as np

STEPS = 4  # batches per epoch per rank in the callback fits
BATCH = 8


def _mlp(seed: int, n_in: int = 5):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((n_in,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(1),
    ])


def _data(seed: int, rows: int = STEPS * BATCH):
    rs = np.random.RandomState(seed)
    x = rs.randn(rows, 5).astype("float32")
    return x, (x @ np.arange(1, 6, dtype="float32"))[:, None]


def _weights(model) -> list:
    return [w.tolist() for w in model.get_weights()]


class _Probe:
    """Build a callback (lazily, keras imported) that records LR per batch, weights, logs."""

    @staticmethod
    def make(record_weights_at: str | None = None):
        import keras

        from hvd_trainer.keras.callbacks._lr import get_lr

        class Probe(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.lrs, self.logs, self.first_weights = [], [], None
                self.epoch = 0

            def on_epoch_begin(self, epoch, logs=None):
                self.epoch = epoch

            def on_train_batch_begin(self, batch, logs=None):
                self.lrs.append((self.epoch, batch, get_lr(self.model.optimizer)))
                if record_weights_at == "begin" and self.first_weights is None:
                    self.first_weights = _weights(self.model)

            def on_train_batch_end(self, batch, logs=None):
                if record_weights_at == "end" and self.first_weights is None:
                    self.first_weights = _weights(self.model)

            def on_epoch_end(self, epoch, logs=None):
                self.logs.append(dict(logs or {}))

        return Probe()


def broadcast_and_fit(rank: int) -> dict:
    """Different init per rank; weights must agree before the first update and after fit."""
    import keras

    import hvd_trainer.keras as hk

    model = _mlp(seed=100 + rank)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    x, y = _data(seed=rank)
    probe = _Probe.make("begin")
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
              callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0), probe])
    return {"first": probe.first_weights, "final": _weights(model),
            "opt_vars": [np.asarray(v).tolist() for v in model.optimizer.variables]}


def sgd_equivalence(rank: int, size: int) -> dict:
    """size ranks x batch b must equal 1 process x batch size*b (same init, plain SGD)."""
    import keras

    import hvd_trainer.keras as hk

    global_batch = BATCH * size
    x, y = _data(seed=7, rows=4 * global_batch)
    mine = np.concatenate([
        np.arange(k * global_batch + rank * BATCH, k * global_batch + (rank + 1) * BATCH)
        for k in range(4)
    ])
    dist_model = _mlp(seed=3)
    dist_model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)),
                       loss="mse")
    dist_model.fit(x[mine], y[mine], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    ref = _mlp(seed=3)
    ref.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    ref.fit(x, y, batch_size=global_batch, epochs=2, shuffle=False, verbose=0)
    def max_diff(m1, m2) -> float:
        pairs = zip(m1.get_weights(), m2.get_weights(), strict=True)
        return max(float(np.abs(a - b).max()) for a, b in pairs)

    return {"max_abs_diff": max_diff(dist_model, ref), "moved": max_diff(_mlp(seed=3), ref)}


def lr_callbacks(rank: int) -> dict:
    """LR per batch under warmup, float schedule (+ resume) and function schedule."""
    import keras

    import hvd_trainer.keras as hk

    x, y = _data(seed=rank)
    out = {}

    def fit(cb, epochs, initial_epoch=0):
        model = _mlp(seed=0)
        model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.2)), loss="mse")
        probe = _Probe.make()
        model.fit(x, y, batch_size=BATCH, epochs=epochs, initial_epoch=initial_epoch, verbose=0,
                  shuffle=False, callbacks=[cb, probe])
        return probe

    p = fit(hk.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2), epochs=3)
    out["warmup"] = p.lrs
    out["warmup_logs_lr"] = [lg.get("learning_rate") for lg in p.logs]
    out["float"] = fit(hk.callbacks.LearningRateScheduleCallback(0.2, 0.5, start_epoch=1, end_epoch=4),
                       epochs=5).lrs
    out["float_resumed"] = fit(
        hk.callbacks.LearningRateScheduleCallback(0.2, 0.5, start_epoch=1, end_epoch=4),
        epochs=5, initial_epoch=2).lrs
    out["float_smooth"] = fit(hk.callbacks.LearningRateScheduleCallback(
        0.2, 0.5, staircase=False, momentum_correction=False), epochs=2).lrs
    out["func"] = fit(hk.callbacks.LearningRateScheduleCallback(
        0.2, multiplier=_inverse, staircase=False), epochs=2).lrs
    return out


def _inverse(epoch: float) -> float:
    return 1.0 / (1.0 + epoch)


# Per-rank "validation" curves: alone, rank 0 would stop after epoch 2 (patience 1) while rank 1
# keeps improving; their average improves every epoch, so averaged runs all epochs everywhere.
FAKE_CURVES = {0: [1.0, 0.9, 0.95, 0.97, 0.99, 0.5], 1: [1.0, 0.7, 0.6, 0.5, 0.4, 0.3]}


def metric_average_early_stopping(rank: int) -> dict:
    import keras

    import hvd_trainer.keras as hk

    class Inject(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["val_fake"] = FAKE_CURVES[rank][epoch]

    model = _mlp(seed=0)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = _data(seed=rank)
    probe = _Probe.make()
    hist = model.fit(x, y, batch_size=BATCH, epochs=len(FAKE_CURVES[0]), verbose=0,
                     validation_data=_data(seed=50 + rank, rows=16),
                     callbacks=[Inject(), hk.callbacks.MetricAverageCallback(),
                                keras.callbacks.EarlyStopping(monitor="val_fake", mode="min", patience=1),
                                probe])
    return {"epochs": len(hist.history["loss"]), "logs": probe.logs}


def save_model(rank: int, path: str) -> None:
    import keras

    import hvd_trainer.keras as hk

    model = _mlp(seed=0)  # with accumulation: its state must stay out of the file
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(0.01), backward_passes_per_step=2),
                  loss="mse")
    x, y = _data(seed=rank)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    if rank == 0:
        model.save(path)
        np.save(path + ".pred.npy", model.predict(x[:4], verbose=0))
        np.save(path + ".x.npy", x[:4])


def mixed_precision_inf(rank: int) -> dict:
    """mixed_float16: rank 1 feeds inf in batch 0; every rank must skip that step, no hang."""
    import keras

    import hvd_trainer.keras as hk

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _mlp(seed=0)
        opt = hk.DistributedOptimizer(keras.optimizers.SGD(0.01))
        model.compile(optimizer=opt, loss="mse")
        x, y = _data(seed=rank)
        x, y = x * 0.1, y * 0.01  # small values: the only non-finite step is the one we inject
        if rank == 1:
            x[0, 0] = np.inf
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0)])
        lso = model.optimizer.inner_optimizer
        return {"scale": float(np.asarray(lso.dynamic_scale)),
                "iterations": int(np.asarray(model.optimizer.iterations)),
                "weights": _weights(model), "lso": type(lso).__name__,
                "finite": all(np.isfinite(w).all() for w in model.get_weights())}
    finally:
        keras.mixed_precision.set_global_policy("float32")


def tf_lazy_and_xla(rank: int) -> dict:
    """TF only: subclassed model (built at the first trace) and jit_compile=True."""
    import keras

    import hvd_trainer.keras as hk

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.d1 = keras.layers.Dense(6, activation="tanh")
            self.d2 = keras.layers.Dense(1)

        def call(self, x):
            return self.d2(self.d1(x))

    keras.utils.set_random_seed(200 + rank)
    model = Net()
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    x, y = _data(seed=rank)
    probe = _Probe.make("end")
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
              callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0), probe])
    out = {"lazy_first": probe.first_weights, "lazy_final": _weights(model),
           "lazy_opt": [np.asarray(v).tolist() for v in model.optimizer.variables]}
    xla = _mlp(seed=0)
    xla.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse",
                jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        xla.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0)])
    out["xla_warned"] = any("jit_compile" in str(w.message) for w in caught)
    out["xla_jit"] = bool(xla.jit_compile)
    out["xla_final"] = _weights(xla)
    return out


def variants(rank: int) -> dict:
    """Same fit with plain / fp16 wire / predivide, and with accumulation (N=2) plain / fp16."""
    import keras

    import hvd_trainer.keras as hk

    x, y = _data(seed=rank)
    wire: dict[str, int] = {}
    out: dict = {"wire_bytes": wire}
    fp16 = {"compression": hk.Compression.fp16}
    for name, kwargs in [("plain", {}), ("fp16", fp16), ("predivide", {"gradient_predivide_factor": 2.0}),
                         ("acc_plain", {"backward_passes_per_step": 2}),
                         ("acc_fp16", {"backward_passes_per_step": 2, **fp16})]:
        m = _mlp(seed=0)
        m.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.05), **kwargs), loss="mse")
        m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        out[name] = _weights(m)
        wire[name] = m.optimizer.wire_bytes_sent
    return out


def adasum(rank: int) -> dict:
    """``op=Adasum``, one SGD(lr=1) step on each rank's own batch: the weight change must be
    minus the per-variable Adasum of the two ranks' gradients (each computed here by a plain
    one-step fit), not their average; with accumulation (N=2) of the same batch twice, twice it."""
    import keras
    import torch

    import hvd_trainer.keras as hk
    from hvd_trainer.comm.ops.adasum import adasum_pair

    data = [_data(seed=20 + r, rows=BATCH) for r in range(2)]

    def one_step(opt, x, y, passes: int = 1) -> list:
        m = _mlp(seed=0)
        m.compile(optimizer=opt, loss="mse")
        m.fit(np.concatenate([x] * passes), np.concatenate([y] * passes), batch_size=BATCH,
              epochs=1, shuffle=False, verbose=0)
        return m.get_weights()

    w0 = _mlp(seed=0).get_weights()
    grads = [[a - b for a, b in zip(w0, one_step(keras.optimizers.SGD(1.0), *data[r]), strict=True)]
             for r in range(2)]
    combined = [adasum_pair(torch.from_numpy(g0).reshape(-1), torch.from_numpy(g1).reshape(-1))
                .numpy().reshape(g0.shape) for g0, g1 in zip(*grads, strict=True)]
    out: dict = {}
    for name, passes in (("step", 1), ("accumulated", 2)):
        opt = hk.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hk.Adasum,
                                      backward_passes_per_step=passes)
        got = one_step(opt, *data[rank], passes=passes)
        out[name] = max(float(np.abs((w - g) - passes * c).max())
                        for w, g, c in zip(w0, got, combined, strict=True))
        out[f"{name}_vs_average"] = max(float(np.abs((w - g) - passes * (g0 + g1) / 2).max())
                                        for w, g, g0, g1 in zip(w0, got, *grads, strict=True))
        out[f"{name}_weights"] = [x.tolist() for x in got]
    return out


ACC_LR = 0.05


def accumulation(rank: int, size: int) -> dict:
    """backward_passes_per_step=2 with plain SGD through the real train step (train_on_batch).

    Rank r's pass p uses micro-batch p*size + r of a window of 2*size (BATCH rows each). Returns
    weights and iterations after each call, plus a single-process reference: one SGD step per
    window on all its micro-batches (MSE is a mean: its gradient is the micro-batches' mean),
    with lr * 2 for the sum over passes of the rank average, lr for average_aggregated_gradients.
    """
    import keras

    import hvd_trainer.keras as hk

    per_window = 2 * size * BATCH
    x, y = _data(seed=11, rows=2 * per_window)
    out: dict = {}

    def micro(window: int, p: int) -> slice:
        start = window * per_window + (p * size + rank) * BATCH
        return slice(start, start + BATCH)

    for avg, lr_factor in ((False, 2.0), (True, 1.0)):
        model = _mlp(seed=3)
        opt = hk.DistributedOptimizer(keras.optimizers.SGD(ACC_LR), backward_passes_per_step=2,
                                      average_aggregated_gradients=avg)
        model.compile(optimizer=opt, loss="mse")
        steps = []
        for window in range(2):
            for p in range(2):
                model.train_on_batch(x[micro(window, p)], y[micro(window, p)])
                steps.append({"iterations": int(np.asarray(model.optimizer.iterations)),
                              "weights": _weights(model)})
        ref = _mlp(seed=3)
        ref.compile(optimizer=keras.optimizers.SGD(ACC_LR * lr_factor), loss="mse")
        refs = []
        for window in range(2):
            rows = slice(window * per_window, (window + 1) * per_window)
            ref.train_on_batch(x[rows], y[rows])
            refs.append(_weights(ref))
        out["avg" if avg else "sum"] = {"init": _weights(_mlp(seed=3)), "steps": steps, "ref": refs}
    return out


def accumulation_fit(rank: int) -> dict:
    """model.fit with N=2, 5 batches per epoch (one left over), 2 epochs; on TF also
    steps_per_execution=2 (the torch backend only allows 1)."""
    import keras

    import hvd_trainer.keras as hk

    model = _mlp(seed=100 + rank)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                                    backward_passes_per_step=2),
                  loss="mse", steps_per_execution=2 if keras.backend.backend() == "tensorflow" else 1)
    x, y = _data(seed=rank, rows=5 * BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
              callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0)])
    return {"iterations": int(np.asarray(model.optimizer.iterations)), "weights": _weights(model),
            "finite": all(np.isfinite(w).all() for w in model.get_weights())}


def argument_errors() -> dict:
    """Each bad argument raises our error naming the value (no collective involved)."""
    import keras

    import hvd_trainer.keras as hk

    cases = {
        "op": lambda: hk.DistributedOptimizer(keras.optimizers.SGD(), op="max"),
        "passes": lambda: hk.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0),
        # "fp16" and "int8" are valid spellings (Compression.resolve); a rank 0 PowerSGD is not
        "compression": lambda: hk.DistributedOptimizer(keras.optimizers.SGD(), compression="powersgd:0"),
        "passes_bool": lambda: hk.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=True),
        "predivide": lambda: hk.DistributedOptimizer(keras.optimizers.SGD(), gradient_predivide_factor=0),
        "kwarg": lambda: hk.DistributedOptimizer(keras.optimizers.SGD(), lr=0.1),
        "type": lambda: hk.DistributedOptimizer("sgd"),
        "twice": lambda: hk.DistributedOptimizer(hk.DistributedOptimizer(keras.optimizers.SGD())),
    }
    out = {}
    for name, make in cases.items():
        try:
            make()
            out[name] = None
        except (TypeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def metric_keys_mismatch(rank: int) -> str | None:
    from hvd_trainer.callbacks import MetricKeysMismatchError, average_metrics

    try:
        average_metrics({"loss": 1.0, ("acc" if rank == 0 else "accuracy"): 0.5})
    except MetricKeysMismatchError as exc:
        return str(exc)
    return None


def suite(backend: str, save_path: str) -> dict:
    import hvd_trainer

    rank, size = hvd_trainer.rank(), hvd_trainer.size()
    results = {
        "broadcast": broadcast_and_fit(rank),
        "equiv": sgd_equivalence(rank, size),
        "lr": lr_callbacks(rank),
        "early": metric_average_early_stopping(rank),
        "mixed": mixed_precision_inf(rank),
        "keys": metric_keys_mismatch(rank),
        "errors": argument_errors(),
        "variants": variants(rank),
        "acc": accumulation(rank, size),
        "acc_fit": accumulation_fit(rank),
        "adasum": adasum(rank),
    }
    save_model(rank, save_path)
    if backend == "tensorflow":
        results["tf"] = tf_lazy_and_xla(rank)
    return results

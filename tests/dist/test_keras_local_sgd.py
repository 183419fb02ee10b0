"""hvd_trainer.keras.callbacks.LocalSGDCallback on 2 processes (Keras on the torch and TensorFlow backends):
sync_every=1 with outer SGD lr 1 equals one process on the global batch; with DiLoCo's defaults
the ranks end with equal weights after the final outer step; an int8 outer gradient too."""

from __future__ import annotations

import numpy as np
import pytest

from tests.multiproc import run_workers

QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"}


def _worker() -> dict:
    import keras

    import hvd_trainer.keras as hk
    from tests.dist._keras_suite import BATCH, _data, _mlp

    rank, size = hk.rank(), hk.size()
    global_batch = BATCH * size
    x, y = _data(seed=7, rows=4 * global_batch)
    mine = np.concatenate([np.arange(k * global_batch + rank * BATCH, k * global_batch + (rank + 1) * BATCH)
                           for k in range(4)])
    model = _mlp(seed=3 + rank)  # rank-dependent init: the callback broadcasts rank 0's
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    sync = hk.callbacks.LocalSGDCallback(sync_every=1, outer_lr=1.0, outer_momentum=0.0, sync_warmup_steps=0)
    model.fit(x[mine], y[mine], batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[sync])
    ref = _mlp(seed=3)
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    ref.fit(x, y, batch_size=global_batch, epochs=2, shuffle=False, verbose=0)

    def max_diff(m1, m2) -> float:  # noqa: ANN001
        pairs = zip(m1.get_weights(), m2.get_weights(), strict=True)
        return max(float(np.abs(a - b).max()) for a, b in pairs)

    diff, moved = max_diff(model, ref), max_diff(_mlp(seed=3), ref)

    dilo = _mlp(seed=3)
    dilo.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    cb = hk.callbacks.LocalSGDCallback(sync_every=3, sync_warmup_steps=0)
    dilo.fit(x[mine], y[mine], batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[cb])

    narrow = _mlp(seed=3)
    narrow.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    cb8 = hk.callbacks.LocalSGDCallback(sync_every=3, compression="int8", sync_warmup_steps=0)
    narrow.fit(x[mine], y[mine], batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[cb8])
    n_values = sum(int(np.prod(w.shape)) for w in narrow.trainable_weights)

    # the synchronous warm-up: batches 1-2 each end with an average of the weights (read after
    # batch 2: equal on both ranks), then outer steps at 5 and 8
    warm = _mlp(seed=3)
    warm.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    cbw = hk.callbacks.LocalSGDCallback(sync_every=3, sync_warmup_steps=2)
    after_warmup: list = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if len(after_warmup) == 0 and cbw.outer is not None and cbw.outer.warmup_left == 0:
                after_warmup.append([w.tolist() for w in warm.get_weights()])

    warm.fit(x[mine], y[mine], batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[cbw, Probe()])
    return {"h1_diff": diff, "moved": moved, "outer_steps": cb.outer.outer_steps,
            "dilo": [w.tolist() for w in dilo.get_weights()], "state_keys": sorted(cb.state_dict()),
            "int8": [w.tolist() for w in narrow.get_weights()], "int8_bytes": cb8.outer.bytes_sent,
            "int8_diff": max(float(np.abs(a - b).max()) for a, b in
                             zip(narrow.get_weights(), dilo.get_weights(), strict=True)),
            "n_values": n_values, "warm": [w.tolist() for w in warm.get_weights()],
            "warm_outer_steps": cbw.outer.outer_steps, "after_warmup": after_warmup[0]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_keras_local_steps(backend: str) -> None:
    results = run_workers(_worker, 2, env={"KERAS_BACKEND": backend, **QUIET}, timeout_seconds=280)
    for r in results:
        assert r["moved"] > 1e-2 and r["h1_diff"] < 1e-5
        assert r["outer_steps"] == 3  # 8 batches: after 3, 6 and the final one at the end
        assert "anchors" in r["state_keys"]
    assert results[0]["dilo"] == results[1]["dilo"]
    assert results[0]["after_warmup"] == results[1]["after_warmup"]  # averaged after each batch
    assert results[0]["warm"] == results[1]["warm"] != results[0]["dilo"]
    assert [r["warm_outer_steps"] for r in results] == [2, 2]
    # int8 outer gradient: equal on every rank, close to (not equal to) the fp32 outer step, and
    # one int8 byte per value, a 4-byte scale per 256 and a 4-byte "used" flag to the other
    # rank, per outer step
    assert results[0]["int8"] == results[1]["int8"]
    for r in results:
        assert 0 < r["int8_diff"] < 5e-2, r["int8_diff"]
        blocks = -(-r["n_values"] // 256)
        assert r["int8_bytes"] == 3 * (blocks * 256 + 4 * blocks + 4)

"""hvd_trainer.keras.callbacks.LocalSGDCallback on 2 processes (Keras on the torch and TensorFlow backends):
sync_every=1 with outer SGD lr 1 (and sync_every="auto" on one host) equals one process on the
global batch; with DiLoCo's defaults
the ranks end with equal weights after the final outer step; an int8 outer gradient too."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from tests.multiproc import run_workers

QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"}


def _overlap_reference(x: np.ndarray, y: np.ndarray, shards: list[np.ndarray], batches: int, h: int,  # noqa: C901
                       tau: int, parts: list[list[int]] | None = None) -> list[np.ndarray]:
    """The hidden outer step by hand (``sync_every=h``, ``overlap_steps=tau``, no warm-up, outer
    Nesterov SGD 0.7 / 0.9): two Keras replicas with their own Adam, each on its shard's batches
    in order; after batch ``h`` the mean of (anchor - replica) is taken and each replica's weights
    kept, ``tau`` batches later the anchor steps and each replica becomes anchor + (its weights now
    - those kept); the end of ``fit`` settles with a blocking outer step. ``parts`` (fragments,
    weight indices): the same per part, part ``k`` of ``F`` launched after every ``h / F``
    batches in turn; ``fit``'s end finishes one launched at its last batch first. Returns the
    weights."""
    import keras

    from tests.dist._keras_suite import BATCH, _mlp

    reps = [_mlp(seed=3) for _ in shards]
    for m in reps:
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    anchor = [w.copy() for w in reps[0].get_weights()]
    buf = [np.zeros_like(a) for a in anchor]

    everything = list(range(len(anchor)))
    parts = parts or [everything]

    def mean_delta(part: list[int]) -> dict[int, np.ndarray]:
        w0, w1 = reps[0].get_weights(), reps[1].get_weights()
        return {i: ((anchor[i] - w0[i]) + (anchor[i] - w1[i])) / 2 for i in part}

    def outer(delta: dict[int, np.ndarray]) -> None:
        for i, d in delta.items():
            buf[i] = 0.9 * buf[i] + d
            anchor[i] = anchor[i] - 0.7 * (d + 0.9 * buf[i])

    def finish(delta: dict[int, np.ndarray], kept: list[list[np.ndarray]]) -> None:
        outer(delta)
        for m, mine in zip(reps, kept, strict=True):
            m.set_weights([w + (anchor[i] - mine[i]) if i in delta else w
                           for i, w in enumerate(m.get_weights())])

    per_epoch = len(shards[0]) // BATCH
    launched = None  # (mean delta, each replica's weights at the launch, batches since)
    launches = 0
    for k in range(batches):
        for m, shard in zip(reps, shards, strict=True):
            idx = shard[(k % per_epoch) * BATCH:(k % per_epoch + 1) * BATCH]
            m.train_on_batch(x[idx], y[idx])
        if launched is not None:
            launched[2] += 1
            if launched[2] == tau:
                finish(*launched[:2])
                launched = None
        if (k + 1) % (h // len(parts)) == 0:
            launched = [mean_delta(parts[launches % len(parts)]), [m.get_weights() for m in reps], 0]
            launches += 1
    if launched is not None:  # launched at the last batch: fit's end finishes it
        assert launched[2] == 0
        finish(*launched[:2])
        if len(parts) == 1:
            return anchor  # the weights are the anchors: nothing left to reduce
    outer(mean_delta(everything))  # the steps since the last one (with parts: every part's)
    return anchor


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

    # sync_every="auto" on one host: no local steps, the weights averaged after every batch (with
    # SGD: one process on the global batch)
    auto_model = _mlp(seed=3 + rank)
    auto_model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    auto_cb = hk.callbacks.LocalSGDCallback(sync_every="auto")
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        auto_model.fit(x[mine], y[mine], batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                       callbacks=[auto_cb])
    auto = {"diff": max_diff(auto_model, ref), "said": said.getvalue(), "sync_every": auto_cb.sync_every}

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

    # the hidden outer step: launched after batches 3 and 6, finished one batch later; fit ends
    # with a blocking one for batches 7-8
    hidden = _mlp(seed=3)
    hidden.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    cbo = hk.callbacks.LocalSGDCallback(sync_every=3, overlap_steps=1, sync_warmup_steps=0)
    hidden.fit(x[mine], y[mine], batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[cbo])
    shards = [np.concatenate([np.arange(k * global_batch + r * BATCH, k * global_batch + (r + 1) * BATCH)
                              for k in range(4)]) for r in range(size)]
    expected = _overlap_reference(x, y, shards, batches=8, h=3, tau=1)
    hidden_diff = max(float(np.abs(a - b).max()) for a, b in zip(hidden.get_weights(), expected, strict=True))

    # fragments: 2 parts (the first kernel; the rest), sync_every=4: a part's outer step
    # launched after batches 2, 4, 6, 8 in turn, finished one batch later; fit's end finishes
    # the one launched at 8 and steps both parts
    parted = _mlp(seed=3)
    parted.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    cbf = hk.callbacks.LocalSGDCallback(sync_every=4, overlap_steps=1, fragments=2, sync_warmup_steps=0)
    parted.fit(x[mine], y[mine], batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[cbf])
    streamed = _overlap_reference(x, y, shards, batches=8, h=4, tau=1, parts=cbf.outer.parts)
    whole = _overlap_reference(x, y, shards, batches=8, h=4, tau=1)
    parted_diff = max(float(np.abs(a - b).max()) for a, b in zip(parted.get_weights(), streamed, strict=True))
    whole_diff = max(float(np.abs(a - b).max()) for a, b in zip(parted.get_weights(), whole, strict=True))
    blocking_diff = max(float(np.abs(a - b).max()) for a, b in zip(dilo.get_weights(), expected, strict=True))
    return {"h1_diff": diff, "moved": moved, "outer_steps": cb.outer.outer_steps, "auto": auto,
            "dilo": [w.tolist() for w in dilo.get_weights()], "state_keys": sorted(cb.state_dict()),
            "int8": [w.tolist() for w in narrow.get_weights()], "int8_bytes": cb8.outer.bytes_sent,
            "int8_diff": max(float(np.abs(a - b).max()) for a, b in
                             zip(narrow.get_weights(), dilo.get_weights(), strict=True)),
            "n_values": n_values, "warm": [w.tolist() for w in warm.get_weights()],
            "warm_outer_steps": cbw.outer.outer_steps, "after_warmup": after_warmup[0],
            "hidden": [w.tolist() for w in hidden.get_weights()], "hidden_diff": hidden_diff,
            "blocking_diff": blocking_diff, "hidden_outer_steps": cbo.outer.outer_steps,
            "parted": [w.tolist() for w in parted.get_weights()], "parts": cbf.outer.parts,
            "parted_diff": parted_diff, "whole_diff": whole_diff, "parted_outer_steps": cbf.outer.outer_steps}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_keras_local_steps(backend: str) -> None:
    results = run_workers(_worker, 2, env={"KERAS_BACKEND": backend, **QUIET}, timeout_seconds=280)
    for r in results:
        assert r["moved"] > 1e-2 and r["h1_diff"] < 1e-5
        assert r["outer_steps"] == 3  # 8 batches: after 3, 6 and the final one at the end
        assert "anchors" in r["state_keys"]
        assert r["auto"]["diff"] < 1e-5 and r["auto"]["sync_every"] == 1, r["auto"]
    line = "hvd_trainer: sync_every=auto chose no local steps: all ranks on one host: plain allreduce.\n"
    assert [r["auto"]["said"] for r in results] == [line, ""]
    assert results[0]["dilo"] == results[1]["dilo"]
    assert results[0]["after_warmup"] == results[1]["after_warmup"]  # averaged after each batch
    assert results[0]["warm"] == results[1]["warm"] != results[0]["dilo"]
    assert [r["warm_outer_steps"] for r in results] == [2, 2]
    # the hidden outer step equals the delayed reference (and the blocking run does not)
    assert results[0]["hidden"] == results[1]["hidden"]
    for r in results:
        assert r["hidden_diff"] < 1e-5 < r["blocking_diff"], (r["hidden_diff"], r["blocking_diff"])
        assert r["hidden_outer_steps"] == 3
    # fragments equal the streaming reference (and not the whole-model one)
    assert results[0]["parted"] == results[1]["parted"]
    for r in results:
        assert r["parts"] == [[0], [1, 2, 3]]  # 30 values; 6 + 6 + 1
        assert r["parted_diff"] < 1e-5 < r["whole_diff"], (r["parted_diff"], r["whole_diff"])
        assert r["parted_outer_steps"] == 5  # 4 parts' steps and the final step of both
    # int8 outer gradient: equal on every rank, close to (not equal to) the fp32 outer step, and
    # one int8 byte per value, a 4-byte scale per 256 and a 4-byte "used" flag to the other
    # rank, per outer step
    assert results[0]["int8"] == results[1]["int8"]
    for r in results:
        assert 0 < r["int8_diff"] < 5e-2, r["int8_diff"]
        blocks = -(-r["n_values"] // 256)
        assert r["int8_bytes"] == 3 * (blocks * 256 + 4 * blocks + 4)

"""Keras ``DistributedOptimizer`` with ``compression="int8"`` / ``"powersgd:2"`` on 2 processes,
on the torch and TensorFlow backends (one spawn per backend).

Values: the first two updates equal a closed-form single-process reference built in the test
process from both ranks' local gradients (int8 blocks / PowerSGD math of
:mod:`hvd_trainer.comm.reduce.compressed`), with the residual (and Q) carried from step 1 to
step 2; this rank's residual after step 1 is the reference's; a fit ends with equal weights on
both ranks, and a resume from weights + optimizer variables + ``compression_state_dict()`` is
bit-identical to training on (also with ``backward_passes_per_step=2``), and so is a
``KerasState`` commit/restore (the elastic rollback carries the residuals).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hvd_trainer.comm.reduce.compressed import int8 as q8
from hvd_trainer.comm.reduce.compressed.powersgd import initial_q, matrix_shape, orthogonalize_
from tests.multiproc import run_workers

QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"}
N_IN, HIDDEN, BATCH, LR = 16, 80, 8, 1.0
MODES = ("int8", "powersgd:2")
PS_RANK = 2


def _model(seed: int):
    """16 -> 80 (tanh) -> 1: the 16x80 kernel (1280 values) is one PowerSGD matrix; the other
    tensors travel uncompressed; 1441 values are 6 int8 blocks."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((N_IN,)), keras.layers.Dense(HIDDEN, activation="tanh"),
                             keras.layers.Dense(1)])


def _batch(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rs = np.random.RandomState(1000 * step + rank)
    x = rs.randn(BATCH, N_IN).astype("float32")
    return x, np.sin(x @ np.linspace(-1, 1, N_IN, dtype="float32"))[:, None]


def _local_grads(model, x, y) -> list[np.ndarray]:
    """This rank's own gradients of the mean squared error (no reduction)."""
    import keras

    loss_fn = keras.losses.MeanSquaredError()
    tvs = model.trainable_variables
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        return [g.numpy() for g in tape.gradient(loss, tvs)]
    for v in tvs:
        v.value.grad = None
    loss_fn(y, model(x)).backward()
    return [v.value.grad.detach().numpy().copy() for v in tvs]


def _apply(opt, model, grads: list[np.ndarray], x, y) -> None:
    """One ``apply()``: on TensorFlow with ``grads``; on torch through backward, so the hook
    reducer (passes == 1) sees the gradients as in ``fit``."""
    import keras

    tvs = model.trainable_variables
    if keras.backend.backend() == "tensorflow":
        opt.apply([keras.ops.convert_to_tensor(g) for g in grads], tvs)
        return
    if opt._passes > 1:  # no hooks: apply() accumulates the gradients it is given
        opt.apply([torch.from_numpy(g) for g in grads], tvs)
        return
    for v in tvs:
        v.value.grad = None
    keras.losses.MeanSquaredError()(y, model(x)).backward()
    opt.apply([v.value.grad for v in tvs], tvs)


def _state(opt) -> dict:
    sd = opt.compression_state_dict()
    return {"compressor": sd["compressor"],
            "residuals": {k: v.cpu().numpy().tolist() for k, v in sd["residuals"].items()},
            "q": {k: v.cpu().numpy().tolist() for k, v in sd["q"].items()}}


def _compressor(mode: str) -> object:
    """``mode`` as the optimizer's ``compression``: PowerSGD from the first step (no warm-up),
    as the references compute it."""
    import hvd_trainer.keras as hk

    if mode.startswith("powersgd:"):
        return hk.Compression.powersgd(rank=int(mode.partition(":")[2]), sync_warmup_steps=0)
    return mode


def _two_steps(mode: str, passes: int) -> dict:
    """Two updates applied by hand (``passes`` apply() calls each) on a fresh optimizer."""
    import keras

    import hvd_trainer.keras as hk

    rank = hk.rank()
    model, twin = _model(3), _model(3)  # the twin gives this rank's local gradients
    opt = hk.DistributedOptimizer(keras.optimizers.SGD(LR), compression=_compressor(mode),
                                  backward_passes_per_step=passes)
    opt.build(model.trainable_variables)
    reducer = opt._reducer
    out = {"paths": [v.path for v in model.trainable_variables], "weights": [], "grads": [], "states": [],
           "layout": reducer.bucket_names if reducer is not None else None}
    out["weights"].append([w.tolist() for w in model.get_weights()])
    for step in range(2):
        step_grads = []
        for p in range(passes):
            x, y = _batch(rank, 10 * step + p)
            twin.set_weights(model.get_weights())
            g = _local_grads(twin, x, y)
            step_grads.append([a.tolist() for a in g])
            _apply(opt, model, g, x, y)
        out["grads"].append(step_grads)
        out["weights"].append([w.tolist() for w in model.get_weights()])
        out["states"].append(_state(opt))
    return out


def _fit_and_resume(mode: str, passes: int) -> dict:
    """fit 4 batches, save, fit 4 more; a fresh model + optimizer loaded from the save fits the
    same 4: the two must end bit-identical."""
    import keras

    import hvd_trainer.keras as hk

    rank = hk.rank()
    xs, ys = zip(*[_batch(rank, 100 + k) for k in range(8)], strict=True)
    x, y = np.concatenate(xs), np.concatenate(ys)

    def make(state: dict | None = None):
        model = _model(5)
        opt = hk.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), compression=_compressor(mode),
                                      backward_passes_per_step=passes)
        if state is not None:  # before build: kept until the torch reducer exists
            opt.load_compression_state_dict(state)
        model.compile(optimizer=opt, loss="mse")
        return model, opt

    model, opt = make()
    model.fit(x[: 4 * BATCH], y[: 4 * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    weights, opt_vars = model.get_weights(), [np.array(v) for v in opt.variables]
    saved = opt.compression_state_dict()
    norm = float(sum(v.double().norm() for v in saved["residuals"].values()))
    elastic = hk.elastic.KerasState(model)  # an elastic commit holds the residuals too
    elastic.commit()
    model.fit(x[4 * BATCH :], y[4 * BATCH :], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    final = [w.tolist() for w in model.get_weights()]
    elastic.restore()  # the in-memory rollback of a failed step, then the same batches again
    model.fit(x[4 * BATCH :], y[4 * BATCH :], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    rolled_back = [w.tolist() for w in model.get_weights()]
    resumed, opt2 = make(saved)
    resumed.set_weights(weights)
    opt2.build(resumed.trainable_variables)
    for v, value in zip(opt2.variables, opt_vars, strict=True):
        v.assign(value)
    resumed.fit(x[4 * BATCH :], y[4 * BATCH :], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return {"final": final, "rolled_back": rolled_back,
            "resumed": [w.tolist() for w in resumed.get_weights()],
            "residual_norm": norm, "names": sorted(saved["residuals"]), "q_names": sorted(saved["q"]),
            "iterations": int(np.array(opt.iterations))}  # restored to 4 by the rollback, then 4 more


CASES = [("int8", 1), ("powersgd:2", 1), ("int8", 2)]
"""(compression, backward_passes_per_step)."""


def _auto_fit() -> dict:
    """compression="auto" with every rank on this host: plain allreduce, the same weights as
    compression=None."""
    import keras

    import hvd_trainer.keras as hk

    xs, ys = zip(*[_batch(hk.rank(), 200 + k) for k in range(3)], strict=True)
    x, y = np.concatenate(xs), np.concatenate(ys)
    out = {}
    for compression in ("auto", None):
        model = _model(7)
        opt = hk.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=compression)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        out[str(compression)] = {"chose": opt.compression.name, "weights": [w.tolist() for w in model.get_weights()]}
    return out


def _worker() -> dict:
    return {"steps": {f"{m}/{p}": _two_steps(m, p) for m, p in CASES},
            "fit": {f"{m}/{p}": _fit_and_resume(m, p) for m, p in CASES}, "auto": _auto_fit()}


# -- the single-process reference -------------------------------------------------------------
def _window_sum(passes: list[torch.Tensor]) -> torch.Tensor:
    total = passes[0].clone()
    for g in passes[1:]:
        total += g
    return total


def _ref_int8(per_rank: list[list[torch.Tensor]], residuals: list[list[torch.Tensor]]):
    """``per_rank[r]``: rank r's gradients (already divided by N), in bucket order."""
    n = sum(t.numel() for t in per_rank[0])
    total = torch.zeros(n)
    new_res = []
    for grads, res in zip(per_rank, residuals, strict=True):
        x = torch.cat([g.reshape(-1) + e.reshape(-1) for g, e in zip(grads, res, strict=True)])
        q, s = q8.quantize(x, 256)
        back = q8.dequantize(q, s, n)
        total += back
        lost, off = x - back, 0
        mine = []
        for g in grads:
            mine.append(lost[off : off + g.numel()].view(g.shape))
            off += g.numel()
        new_res.append(mine)
    out, off = [], 0
    for g in per_rank[0]:
        out.append(total[off : off + g.numel()].view(g.shape))
        off += g.numel()
    return out, new_res


def _ref_powersgd(name: str, per_rank: list[torch.Tensor], residuals: list[torch.Tensor],
                  q: torch.Tensor | None):
    shape = matrix_shape(per_rank[0].shape, PS_RANK, 1024)
    if shape is None:
        return sum(per_rank[1:], per_rank[0]), residuals, None
    ms = [g.reshape(shape) + e.reshape(shape) for g, e in zip(per_rank, residuals, strict=True)]
    q = initial_q(name, shape[1], PS_RANK, 0, torch.device("cpu")) if q is None else q
    p = orthogonalize_(sum(m @ q for m in ms))
    q_new = sum(m.T @ p for m in ms)
    approx = p @ q_new.T
    shares = [(m - approx / len(ms)).view(e.shape) for m, e in zip(ms, residuals, strict=True)]
    return approx.view(per_rank[0].shape), shares, q_new


def _reference(mode: str, steps: list[list[list[list[list[float]]]]], paths: list[str],
               layout: list[str], carry: bool = True) -> list[tuple[list[torch.Tensor], list[dict]]]:
    """``(reduced gradients, residuals by name per rank)`` of each step; ``steps[r][k][p]``: rank
    r's gradients at step k, pass p; ``layout``: the names in bucket order (int8's blocks run
    across the bucket); ``carry=False``: every step starts from an empty state."""
    size = len(steps)
    names = [f"{i}:{p}" for i, p in enumerate(paths)]
    order = [names.index(n) for n in layout]
    res = [[torch.zeros(np.array(g).shape) for g in steps[0][0][0]] for _ in range(size)]
    qs: dict[int, torch.Tensor] = {}
    out = []
    for k in range(len(steps[0])):
        if not carry:
            res = [[torch.zeros_like(e) for e in r] for r in res]
            qs = {}
        # each rank's gradient summed over the window's passes (in fp32, in pass order), then
        # the pre-sum factor 1/N (exact: N = 2)
        local = [[_window_sum([torch.tensor(g[i], dtype=torch.float32) for g in steps[r][k]]) / size
                  for i in range(len(names))] for r in range(size)]
        reduced: list[torch.Tensor] = [torch.empty(0)] * len(names)
        if mode == "int8":
            got, new = _ref_int8([[local[r][i] for i in order] for r in range(size)],
                                 [[res[r][i] for i in order] for r in range(size)])
            for j, i in enumerate(order):
                reduced[i] = got[j]
                for r in range(size):
                    res[r][i] = new[r][j]
        else:
            for i, name in enumerate(names):
                got, new, q = _ref_powersgd(name, [local[r][i] for r in range(size)],
                                            [res[r][i] for r in range(size)], qs.get(i))
                reduced[i] = got
                for r in range(size):
                    res[r][i] = new[r]
                if q is not None:
                    qs[i] = q
        out.append((reduced, [dict(zip(names, r, strict=True)) for r in res]))
    return out


@pytest.fixture(scope="module", params=["torch", "tensorflow"])
def results(request) -> tuple[str, list[dict]]:
    backend = request.param
    return backend, run_workers(_worker, 2, env={"KERAS_BACKEND": backend, **QUIET}, timeout_seconds=280)


def _close(a, b, atol: float) -> bool:
    return all(np.allclose(np.array(x), np.array(y), atol=atol, rtol=0) for x, y in zip(a, b, strict=True))


def _expected_weights(before: list, reduced: list[torch.Tensor]) -> list[np.ndarray]:
    """Plain SGD with lr 1.0: ``w - g`` in fp32."""
    return [np.float32(w) - g.numpy() for w, g in zip(before, reduced, strict=True)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mode", "passes"), CASES)
def test_first_two_updates_equal_the_reference_with_carried_residual(results, mode: str, passes: int) -> None:
    backend, ranks = results
    runs = [r["steps"][f"{mode}/{passes}"] for r in ranks]
    paths = runs[0]["paths"]
    names = [f"{i}:{p}" for i, p in enumerate(paths)]
    # torch without accumulation: the hook reducer's one bucket, last layer first; otherwise
    # reduce_with_feedback's bucket in variable order
    layout = runs[0]["layout"][0] if runs[0]["layout"] else names
    assert len(runs[0]["layout"] or [layout]) == 1, runs[0]["layout"]
    if backend == "torch" and passes == 1:
        assert layout == names[::-1]
    grads = [run["grads"] for run in runs]
    ref = _reference(mode, grads, paths, layout)
    fresh = _reference(mode, grads, paths, layout, carry=False)
    atol = 0.0 if mode == "int8" else 1e-5  # int8: elementwise math, bit-exact; PowerSGD: matmuls
    for rank, run in enumerate(runs):
        assert run["weights"][1] == runs[0]["weights"][1] and run["weights"][2] == runs[0]["weights"][2]
        for k in range(2):
            want = _expected_weights(run["weights"][k], ref[k][0])
            assert _close(run["weights"][k + 1], want, atol=max(atol, 1e-7)), (backend, mode, rank, k)
            residuals = run["states"][k]["residuals"]
            # PowerSGD keeps a residual for its matrices only (the rest is sent exactly)
            assert sorted(residuals) == (names[:1] if mode.startswith("powersgd") else sorted(names))
            for name, got in residuals.items():
                want = ref[k][1][rank][name].numpy()
                assert np.allclose(got, want, atol=max(atol, 1e-7), rtol=0), (backend, mode, rank, k, name)
        # the residual of step 1 is nonzero and carried: a fresh state would give another step 2
        assert sum(np.abs(np.array(v)).sum() for v in run["states"][0]["residuals"].values()) > 1e-4
        assert not _close(run["weights"][2], _expected_weights(run["weights"][1], fresh[1][0]), atol=1e-6)
    if mode.startswith("powersgd"):
        assert sorted(runs[0]["states"][1]["q"]) == [names[0]]  # only the 16x80 kernel is a matrix
        assert runs[0]["states"][1]["q"] == runs[1]["states"][1]["q"]  # Q is the same on every rank


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mode", "passes"), CASES)
def test_fit_keeps_ranks_equal_and_resumes_bit_identically(results, mode: str, passes: int) -> None:
    backend, ranks = results
    fits = [r["fit"][f"{mode}/{passes}"] for r in ranks]
    for f in fits:
        assert f["iterations"] == 8 and f["residual_norm"] > 0
        assert f["resumed"] == f["final"], (backend, mode, passes)  # bit-identical
        assert f["rolled_back"] == f["final"], (backend, mode, passes)  # KerasState restores them
        if mode.startswith("powersgd"):
            assert f["q_names"] == f["names"] and len(f["names"]) == 1  # the 16x80 kernel
        else:
            assert f["q_names"] == [] and len(f["names"]) == 4
    assert fits[0]["final"] == fits[1]["final"]


@pytest.mark.timeout(300)
def test_auto_on_one_host_is_plain_allreduce(results) -> None:
    backend, ranks = results
    for r in ranks:
        assert r["auto"]["auto"]["chose"] == "none", backend
        assert r["auto"]["auto"]["weights"] == r["auto"]["None"]["weights"], backend
    assert ranks[0]["auto"]["auto"]["weights"] == ranks[1]["auto"]["auto"]["weights"]

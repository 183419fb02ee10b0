"""Keras ``DistributedOptimizer(zero_stage=1|2)`` on 2 and 3 processes (torch backend, gloo).

Values: K Adam steps with each stage give weights equal on every rank and equal (atol 1e-6) to
``zero_stage=0`` on the same data; each rank's Adam slot bytes are at most ``unsharded / N +``
the largest variable's slot bytes, and they add up to the unsharded figure; after
``consolidate_variables(to=0)`` rank 0's ``save_own_variables`` / ``model.save`` hold exactly the
slots of the unsharded run (a plain Keras ``Adam`` loads them), saving unconsolidated raises and
leaves no loadable file, and loading the full state into a fresh sharded optimizer gives each rank its
shard back. ``full_state()`` gives every rank the unsharded state by name, and
``load_full_state`` (in the same world: the plan kept) trains on as stage 0 does. ``model.fit`` with
``zero_stage=2`` trains with ranks equal (and equal to stage 0). The unsupported combinations are
refused with errors naming the option.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.multiproc import run_workers

QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"}
N_IN, BATCH, STEPS, LR = 12, 8, 4, 0.01


def _model(seed: int):
    """12 -> 40 (tanh) -> 16 (tanh) -> 1: six variables of 480, 40, 640, 16, 16 and 1 values."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((N_IN,)), keras.layers.Dense(40, activation="tanh"),
                             keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])


def _batch(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rs = np.random.RandomState(1000 * step + rank)
    x = rs.randn(BATCH, N_IN).astype("float32")
    return x, np.sin(x @ np.linspace(-1, 1, N_IN, dtype="float32"))[:, None]


def _step(opt, model, x, y) -> None:
    """One update the way Keras' torch ``train_step`` does it (backward, then ``apply``)."""
    import keras

    tvs = model.trainable_variables
    for v in tvs:
        v.value.grad = None
    keras.losses.MeanSquaredError()(keras.ops.convert_to_tensor(y), model(x)).backward()
    opt.apply([v.value.grad for v in tvs], tvs)


def _slots(optimizer) -> list[list]:
    from hvd_trainer.keras._zero import slot_variables

    return [np.array(v).tolist() for v in slot_variables(optimizer)]


def _train(stage: int, tmp: str) -> dict:
    import keras
    import torch.distributed as dist

    import hvd_trainer.keras as hk
    from hvd_trainer.keras._zero import state_bytes

    rank = hk.rank()
    model = _model(11)
    opt = hk.DistributedOptimizer(keras.optimizers.Adam(LR), zero_stage=stage)
    start = [w.tolist() for w in model.get_weights()]
    for k in range(STEPS):
        _step(opt, model, *_batch(rank, k))
    out = {"start": start, "weights": [w.tolist() for w in model.get_weights()],
           "bytes": state_bytes(opt.inner_optimizer),
           "iterations": int(np.array(opt.iterations)),
           "var_bytes": [2 * int(np.prod(v.shape)) * 4 for v in model.trainable_variables]}
    if stage == 0:
        out["slots"] = _slots(opt.inner_optimizer)
        out.update(_reloaded(stage, rank))
        return out
    # saving before consolidation: refused on every rank, nothing written
    path = os.path.join(tmp, f"s{stage}_r{rank}.keras")
    model.compile(optimizer=opt, loss="mse")
    try:
        model.save(path)
        out["unconsolidated_save"] = "saved"
    except hk.DistributedOptimizerError as exc:
        out["unconsolidated_save"] = str(exc)
    # Keras opens the file before it asks the optimizer for its variables: what is left is a
    # truncated archive that does not load (never a loadable partial state)
    out["unconsolidated_loads"] = False
    if os.path.exists(path):
        try:
            keras.models.load_model(path)
            out["unconsolidated_loads"] = True
        except Exception:  # noqa: BLE001 - any failure to load is what we want
            pass
        os.remove(path)
    opt.consolidate_variables(to=0)
    if rank == 0:
        store: dict = {}
        opt.save_own_variables(store)
        plain = keras.optimizers.Adam(LR)
        plain.build(model.trainable_variables)
        plain.load_own_variables(store)
        out["plain_slots"] = _slots(plain)
        out["plain_iterations"] = int(np.array(plain.iterations))
        np.savez(os.path.join(tmp, f"full{stage}.npz"), **store)
        model.save(path)
        loaded = keras.models.load_model(path)
        out["loaded_class"] = type(loaded.optimizer).__name__
        out["loaded_slots"] = _slots(loaded.optimizer)
    else:
        try:
            opt.save_own_variables({})
            out["other_rank_save"] = "saved"
        except hk.DistributedOptimizerError as exc:
            out["other_rank_save"] = str(exc)
    dist.barrier()
    # the full state loaded into a fresh sharded optimizer: each rank keeps its own shard
    fresh = hk.DistributedOptimizer(keras.optimizers.Adam(LR), zero_stage=stage)
    fresh.build(model.trainable_variables)
    with np.load(os.path.join(tmp, f"full{stage}.npz")) as data:
        fresh.load_own_variables({k: data[k] for k in data.files})
    out["reloaded_equal"] = _slots(fresh.inner_optimizer) == _slots(opt.inner_optimizer)
    # model.load_weights of rank 0's .keras file into another model with a built sharded optimizer
    other = _model(3)
    other.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(LR), zero_stage=stage), loss="mse")
    other.optimizer.build(other.trainable_variables)
    other.load_weights(os.path.join(tmp, f"s{stage}_r0.keras"))
    out["load_weights_equal"] = _slots(other.optimizer.inner_optimizer) == _slots(opt.inner_optimizer) \
        and [w.tolist() for w in other.get_weights()] == out["weights"]
    out["reloaded_iterations"] = int(np.array(fresh.iterations))
    out["reloaded_names"] = [v.name for v in fresh.inner_optimizer.variables] == \
        [v.name for v in opt.inner_optimizer.variables]
    out.update(_reloaded(stage, rank))
    return out


def _reloaded(stage: int, rank: int) -> dict:
    """K steps on a model of its own, then the full state (every rank's shards by name, on every
    rank; listed in a plain Adam's variable order), loaded back in the same world (the plan and
    inner optimizer kept; the e2e test covers a new world's plan), then 2 more steps."""
    import keras

    import hvd_trainer.keras as hk

    model = _model(11)
    opt = hk.DistributedOptimizer(keras.optimizers.Adam(LR), zero_stage=stage)
    for k in range(STEPS):
        _step(opt, model, *_batch(rank, k))
    full = opt.full_state()
    plain = keras.optimizers.Adam(LR)
    plain.build(model.trainable_variables)
    ordered = [np.array(full[v.name]).tolist() for v in plain.variables]
    inner = opt.inner_optimizer
    opt.load_full_state(full)  # the same world: the shards stay planned as they were
    kept = opt.inner_optimizer is inner
    for k in range(2):
        _step(opt, model, *_batch(rank, STEPS + k))
    return {"full": ordered, "names": len(full) == len(plain.variables), "kept": kept,
            "after_reload": [w.tolist() for w in model.get_weights()]}


def _accumulated(stage: int) -> dict:
    """``backward_passes_per_step=2`` (stage 1 supports it): 4 apply() calls, 2 updates."""
    import keras

    import hvd_trainer.keras as hk

    model = _model(17)
    opt = hk.DistributedOptimizer(keras.optimizers.Adam(LR), backward_passes_per_step=2, zero_stage=stage)
    for k in range(4):
        _step(opt, model, *_batch(hk.rank(), 30 + k))
    return {"weights": [w.tolist() for w in model.get_weights()], "iterations": int(np.array(opt.iterations))}


def _fit(stage: int) -> list:
    import keras

    import hvd_trainer.keras as hk

    xs, ys = zip(*[_batch(hk.rank(), 50 + k) for k in range(5)], strict=True)
    model = _model(13)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(LR), zero_stage=stage), loss="mse")
    model.fit(np.concatenate(xs), np.concatenate(ys), batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0)])
    return [w.tolist() for w in model.get_weights()]


def _refusals() -> dict:
    import keras

    import hvd_trainer.keras as hk

    cases = {
        "stage3": lambda: hk.DistributedOptimizer(keras.optimizers.Adam(), zero_stage=3),
        "bool": lambda: hk.DistributedOptimizer(keras.optimizers.Adam(), zero_stage=True),
        "int8": lambda: hk.DistributedOptimizer(keras.optimizers.Adam(), compression="int8", zero_stage=1),
        "powersgd": lambda: hk.DistributedOptimizer(keras.optimizers.Adam(), compression="powersgd:2",
                                                    zero_stage=2),
        "auto": lambda: hk.DistributedOptimizer(keras.optimizers.Adam(), compression="auto", zero_stage=1),
        "fp16": lambda: hk.DistributedOptimizer(keras.optimizers.Adam(), compression="fp16", zero_stage=2),
        "passes": lambda: hk.DistributedOptimizer(keras.optimizers.Adam(), backward_passes_per_step=2,
                                                  zero_stage=2),
        "lso": lambda: hk.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
                                               zero_stage=1),
        "ema": lambda: hk.DistributedOptimizer(keras.optimizers.Adam(use_ema=True), zero_stage=1),
        "global_clipnorm": lambda: hk.DistributedOptimizer(keras.optimizers.Adam(global_clipnorm=1.0),
                                                           zero_stage=1),
    }
    out = {}
    for name, make in cases.items():
        try:
            make()
            out[name] = "accepted"
        except hk.DistributedOptimizerError as exc:
            out[name] = str(exc)
    # a local variable registered after build changes the plan: refused
    model = _model(1)
    opt = hk.DistributedOptimizer(keras.optimizers.Adam(), zero_stage=1)
    opt.build(model.trainable_variables)
    try:
        opt.register_local_var(model.trainable_variables[0])
        out["late_local"] = "accepted"
    except hk.DistributedOptimizerError as exc:
        out["late_local"] = str(exc)
    return out


def _worker(tmp: str) -> dict:
    return {"runs": {s: _train(s, tmp) for s in (0, 1, 2)}, "refusals": _refusals(),
            "accumulated": {s: _accumulated(s) for s in (0, 1)}}


def _fit_worker() -> dict:
    return {s: _fit(s) for s in (0, 2)}


def _tf_refusal() -> str:
    import keras

    import hvd_trainer.keras as hk

    try:
        hk.DistributedOptimizer(keras.optimizers.Adam(), zero_stage=1)
    except hk.DistributedOptimizerError as exc:
        return str(exc)
    return "accepted"


@pytest.fixture(scope="module", params=[2, 3])
def results(request, tmp_path_factory) -> tuple[int, list[dict]]:
    size = request.param
    tmp = str(tmp_path_factory.mktemp(f"zero{size}"))
    return size, run_workers(_worker, size, args=(tmp,), env={"KERAS_BACKEND": "torch", **QUIET},
                             timeout_seconds=280)


def _close(a, b, atol: float = 1e-6) -> bool:
    return all(np.allclose(np.array(x), np.array(y), atol=atol, rtol=0) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_weights_equal_on_every_rank_and_to_stage0(results, stage: int) -> None:
    size, ranks = results
    ref = ranks[0]["runs"][0]["weights"]
    assert all(r["runs"][0]["weights"] == ref for r in ranks)
    for r in ranks:
        run = r["runs"][stage]
        assert run["weights"] == ranks[0]["runs"][stage]["weights"], (size, stage)  # bit-equal
        assert _close(run["weights"], ref), (size, stage)
        assert run["iterations"] == STEPS
    assert not _close(ref, ranks[0]["runs"][0]["start"], atol=1e-4)  # the steps moved the weights


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_state_bytes_are_sharded(results, stage: int) -> None:
    size, ranks = results
    unsharded = ranks[0]["runs"][0]["bytes"]
    largest = max(ranks[0]["runs"][0]["var_bytes"])
    assert unsharded == sum(ranks[0]["runs"][0]["var_bytes"]) == 2 * 4 * 1193
    per_rank = [r["runs"][stage]["bytes"] for r in ranks]
    assert sum(per_rank) == unsharded, per_rank  # every slot on exactly one rank
    for b in per_rank:
        assert 0 < b <= unsharded / size + largest, (size, per_rank, unsharded, largest)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_consolidated_save_is_the_unsharded_state(results, stage: int) -> None:
    size, ranks = results
    ref = ranks[0]["runs"][0]["slots"]
    run0 = ranks[0]["runs"][stage]
    assert run0["plain_iterations"] == STEPS
    assert len(run0["plain_slots"]) == len(ref) == 12  # Adam: momentum + velocity per variable
    assert _close(run0["plain_slots"], ref)
    assert run0["loaded_class"] == "Adam"  # model.save names a plain Keras Adam ...
    assert _close(run0["loaded_slots"], ref)  # ... holding the full state
    for rank, r in enumerate(ranks):
        run = r["runs"][stage]
        assert "consolidate_variables(to=r) on every rank" in run["unconsolidated_save"], run
        assert run["unconsolidated_loads"] is False, (rank, "a partial state was saved")
        if rank:
            assert "consolidate_variables" in run["other_rank_save"]
        assert run["reloaded_equal"] and run["reloaded_names"], (size, stage, rank)
        assert run["load_weights_equal"], (size, stage, rank)
        assert run["reloaded_iterations"] == STEPS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_full_state_is_the_unsharded_state_and_loads_back(results, stage: int) -> None:
    size, ranks = results
    ref = ranks[0]["runs"][0]
    assert len(ref["full"]) == 2 + 12  # iterations, learning rate, Adam's two slots per variable
    for r in ranks:
        run = r["runs"][stage]
        assert run["names"], (size, stage)  # every rank holds every shard, nothing more
        assert run["kept"], (size, stage)  # the world did not change: no new plan
        assert _close(run["full"], ref["full"]), (size, stage)
        assert run["after_reload"] == ranks[0]["runs"][stage]["after_reload"]  # ranks bit-equal
        assert _close(run["after_reload"], ref["after_reload"]), (size, stage)  # = unsharded Adam
    assert not _close(ref["after_reload"], ref["weights"], atol=1e-4)  # the 2 steps moved them


@pytest.mark.timeout(300)
def test_stage1_with_gradient_accumulation_equals_stage0(results) -> None:
    size, ranks = results
    ref = ranks[0]["accumulated"][0]
    for r in ranks:
        assert r["accumulated"][1]["weights"] == ranks[0]["accumulated"][1]["weights"]
        assert _close(r["accumulated"][1]["weights"], ref["weights"]), size
        assert r["accumulated"][1]["iterations"] == ref["iterations"] == 4


@pytest.mark.timeout(300)
def test_refusals_name_the_option(results) -> None:
    size, ranks = results
    got = ranks[0]["refusals"]
    want = {"stage3": "zero_stage=3", "bool": "got the bool True", "int8": "compression='int8'",
            "powersgd": "compression='powersgd", "auto": "compression='auto'", "fp16": "compression='fp16'",
            "passes": "backward_passes_per_step=2", "lso": "LossScaleOptimizer", "ema": "use_ema",
            "global_clipnorm": "global_clipnorm", "late_local": "register_local_var"}
    for name, text in want.items():
        assert text in got[name] and "HINT" in got[name], (name, got[name])


@pytest.mark.timeout(300)
def test_fit_with_stage2_keeps_ranks_equal() -> None:
    ranks = run_workers(_fit_worker, 2, env={"KERAS_BACKEND": "torch", **QUIET}, timeout_seconds=200)
    assert ranks[0][2] == ranks[1][2]
    assert ranks[0][0] == ranks[1][0]
    assert _close(ranks[0][2], ranks[0][0])


@pytest.mark.timeout(200)
def test_tensorflow_backend_is_refused() -> None:
    (msg,) = run_workers(_tf_refusal, 1, env={"KERAS_BACKEND": "tensorflow", **QUIET}, timeout_seconds=150)
    assert "KERAS_BACKEND='tensorflow'" in msg and "torch backend" in msg and "zero_stage=0" in msg, msg

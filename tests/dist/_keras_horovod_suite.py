"""Checks run inside each spawned worker of tests/dist/test_keras_horovod.py (one spawn per
backend): Horovod's Keras API surface (local variables, partial optimizer, from_config,
sparse_as_dense, elastic state and callbacks). Every function returns plain Python data."""

from __future__ import annotations

import numpy as np

LR = 0.1
BATCH = 8


def _mlp(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(6, activation="tanh", name="body"),
        keras.layers.Dense(1, name="head"),
    ])


def _data(seed: int, rows: int = BATCH):
    rs = np.random.RandomState(seed)
    x = rs.randn(rows, 5).astype("float32")
    return x, (x @ np.arange(1, 6, dtype="float32"))[:, None]


def _w(weights) -> list:
    return [np.asarray(w).tolist() for w in weights]


def broadcast_local_variables(rank: int) -> dict:
    """Different init per rank, lr 0: the head stays per rank, everything else is rank 0's."""
    import keras

    import hvd_trainer.keras as hk

    model = _mlp(seed=10 + rank)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    init = {name: _w(model.get_layer(name).get_weights()) for name in ("body", "head")}
    cb = hk.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=model.get_layer("head").weights)
    x, y = _data(seed=rank)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[cb])
    try:
        hk.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[np.zeros(2)])
        bad = None
    except TypeError as exc:
        bad = str(exc)
    return {"init": init, "body": _w(model.get_layer("body").get_weights()),
            "head": _w(model.get_layer("head").get_weights()), "bad": bad}


def from_config(rank: int) -> dict:
    import keras

    import hvd_trainer.keras as hk

    opt = hk.DistributedOptimizer(keras.optimizers.Adam(0.003, beta_1=0.8), compression="fp16",
                                  backward_passes_per_step=2, gradient_predivide_factor=2.0)
    cfg = opt.get_config()
    copy = opt.from_config(cfg)
    out = {
        "copy_type": type(copy).__name__, "copy_cfg_equal": copy.get_config() == cfg,
        "copy_options": [copy._passes, type(copy.compression).__name__, copy._predivide],
        "class_copy_cfg_equal": opt.__class__.from_config(cfg).get_config() == cfg,
        "class_copy_type": type(opt.__class__.from_config(cfg)).__name__,
    }
    served = hk.DistributedOptimizer.from_config(keras.optimizers.serialize(keras.optimizers.SGD(0.25)))
    out["served"] = [type(served).__name__, float(np.asarray(served.learning_rate))]
    try:
        hk.DistributedOptimizer.from_config(cfg)
        out["bare_error"] = None
    except hk.DistributedOptimizerError as exc:
        out["bare_error"] = str(exc)
    # Horovod's positional order: optimizer, name, device_dense, device_sparse, compression
    positional = hk.DistributedOptimizer(keras.optimizers.SGD(0.1), None, "", "", hk.Compression.fp16)
    out["positional_compression"] = type(positional.compression).__name__
    # Horovod's order for the LR callbacks: ..., momentum_correction, steps_per_epoch
    warm = hk.callbacks.LearningRateWarmupCallback(0.4, 2, False, 7)
    sched = hk.callbacks.LearningRateScheduleCallback(0.4, 0.5, 1, 3, False, False, 7)
    out["lr_positional"] = [warm.warmup_epochs, warm.steps_per_epoch, sched.schedule.staircase,
                            sched.steps_per_epoch, sched.schedule.end_epoch]
    # the copy trains: both ranks end identical
    model = _mlp(seed=100 + rank)
    model.compile(optimizer=copy, loss="mse")
    x, y = _data(seed=rank, rows=4 * BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
              callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0)])
    out["trained"] = _w(model.get_weights())
    out["iterations"] = int(np.asarray(model.optimizer.iterations))
    return out


def partial(rank: int, size: int) -> dict:
    """Same init everywhere, per-rank data; the head's gradient stays local."""
    import keras

    import hvd_trainer.keras as hk

    x, y = _data(seed=rank)
    out: dict = {}
    cases = {
        "scaled": dict(passes=1, scale=True),
        "unscaled": dict(passes=1, scale=False),
        "accumulated": dict(passes=2, scale=True),
    }
    for name, case in cases.items():
        model = _mlp(seed=3)
        head = model.get_layer("head")
        if case["scale"]:
            opt = hk.PartialDistributedOptimizer(keras.optimizers.SGD(LR), local_layers=[head],
                                                 backward_passes_per_step=case["passes"])
        else:
            opt = hk.DistributedOptimizer(keras.optimizers.SGD(LR), scale_local_gradients=False)
            for var in head.trainable_weights:
                opt.register_local_var(var)
        model.compile(optimizer=opt, loss="mse")
        for _ in range(case["passes"]):
            model.train_on_batch(x, y)
        # reference: the head's update from this rank's gradient alone, lr / size when scaled
        # (the body does not move before the last pass, so each pass has the same gradient)
        ref = _mlp(seed=3)
        ref_lr = LR * case["passes"] / (size if case["scale"] else 1)
        ref.compile(optimizer=keras.optimizers.SGD(ref_lr), loss="mse")
        ref.train_on_batch(x, y)
        out[name] = {"body": _w(model.get_layer("body").get_weights()),
                     "head": _w(head.get_weights()),
                     "ref_head": _w(ref.get_layer("head").get_weights()),
                     "ref_body": _w(ref.get_layer("body").get_weights()),
                     "local": len(opt.local_variables)}
    try:
        hk.PartialDistributedOptimizer(keras.optimizers.SGD(LR), local_layers=["head"])
        out["bad"] = None
    except TypeError as exc:
        out["bad"] = str(exc)
    return out


def process_sets(rank: int) -> dict:
    """process_set=: the set of both ranks averages; a set of rank 0 alone leaves every rank
    with its own gradient (rank 0 is a one-member set, rank 1 is outside it)."""
    import keras

    import hvd_trainer.keras as hk
    from hvd_trainer.comm import ProcessSet

    both, only0 = ProcessSet([0, 1]), ProcessSet([0])
    x, y = _data(seed=rank)
    out = {}
    for name, kwargs in (("default", {}), ("both", {"process_set": both}), ("only0", {"process_set": only0}),
                         ("both_predivide", {"process_set": both, "gradient_predivide_factor": 2.0})):
        model = _mlp(seed=3)
        model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(LR), **kwargs), loss="mse")
        model.train_on_batch(x, y)
        out[name] = _w(model.get_weights())
    # Horovod's module-level process-set API, as horovod.tensorflow has it
    added = hk.add_process_set([1])
    for name, pset in (("global", hk.global_process_set), ("added1", added)):
        model = _mlp(seed=3)
        opt = hk.DistributedOptimizer(keras.optimizers.SGD(LR), process_set=pset)
        model.compile(optimizer=opt, loss="mse")
        model.train_on_batch(x, y)
        out[name] = _w(model.get_weights())
    out["global_set"] = [hk.global_process_set.process_set_id, hk.global_process_set.ranks]
    out["ids_and_ranks"] = hk.mpi_ops._basics._get_process_set_ids_and_ranks()  # Horovod's internal
    out["removed"] = [hk.remove_process_set(added), added.process_set_id]
    ref = _mlp(seed=3)
    ref.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    ref.train_on_batch(x, y)
    out["alone"] = _w(ref.get_weights())
    return out


def sparse_as_dense(rank: int, size: int) -> dict:
    """Embedding model: size ranks x batch b equal one process x the global batch."""
    import keras

    import hvd_trainer.keras as hk

    rs = np.random.RandomState(5)
    ids = rs.randint(0, 10, size=(BATCH * size, 3)).astype("int32")
    target = rs.randn(BATCH * size, 1).astype("float32")
    mine = slice(rank * BATCH, (rank + 1) * BATCH)

    def model():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4),
                                 keras.layers.Flatten(), keras.layers.Dense(1)])

    out = {}
    for flag in (True, False):
        m = model()
        m.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(LR), sparse_as_dense=flag),
                  loss="mse")
        for _ in range(2):
            m.train_on_batch(ids[mine], target[mine])
        out[str(flag)] = _w(m.get_weights())
    ref = model()
    ref.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    for _ in range(2):
        ref.train_on_batch(ids, target)
    out["ref"] = _w(ref.get_weights())
    out["init"] = _w(model().get_weights())
    return out


def state_sync_unbuilt(rank: int) -> dict:
    """KerasState.sync() when the optimizer of rank 0 (or of every rank) is not built yet."""
    import keras

    import hvd_trainer.keras as hk

    out = {}
    for case in ("root_fresh", "all_fresh"):
        model = _mlp(seed=20 + rank)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        if case == "root_fresh" and rank != 0:
            x, y = _data(seed=rank)
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # builds and moves Adam's slots
        # Horovod's positional form KerasState(model, optimizer, backend): backend is unused
        state = hk.elastic.KerasState(model, None, keras.backend, epoch=rank)
        state.sync()
        out[case] = {"weights": _w(model.get_weights()),
                     "opt": _w([v.numpy() for v in model.optimizer.variables]),
                     "n_opt": len(model.optimizer.variables), "epoch": state.epoch,
                     "has_backend_attr": "backend" in state._names,
                     "init0": _w(_mlp(seed=20).get_weights())}
    return out


def elastic_callbacks(rank: int) -> dict:
    """Commit every 3 batches + each epoch end; epoch/batch kept in the state; run() syncs."""
    import keras

    import hvd_trainer.elastic as core_elastic
    import hvd_trainer.keras as hk

    model = _mlp(seed=0)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    state = hk.elastic.KerasState(model, batch=0, epoch=0)
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append(("steps", epoch, self.params.get("steps")))

        def on_train_batch_end(self, batch, logs=None):
            seen.append(("batch", state.batch, state.commit_count))

    x, y = _data(seed=rank, rows=4 * BATCH)

    @hk.elastic.run
    def train(st):
        model.fit(x, y, batch_size=BATCH, epochs=2 - st.epoch, verbose=0, callbacks=[
            hk.elastic.UpdateEpochStateCallback(st), hk.elastic.UpdateBatchStateCallback(st),
            hk.elastic.CommitStateCallback(st, batches_per_commit=3), Probe()])
        return st.epoch, st.batch, st.commit_count

    result = train(state)
    state.batch = 2  # as after a restart in the middle of an epoch
    short = []

    class Steps(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            short.append(self.params.get("steps"))

    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
              callbacks=[hk.elastic.UpdateBatchStateCallback(state), Steps()])
    try:
        hk.elastic.CommitStateCallback(state, batches_per_commit=0)
        bad = None
    except ValueError as exc:
        bad = str(exc)
    return {"result": list(result), "seen": seen, "short": short, "bad": bad,
            "same_objects": [hk.elastic.KerasState is core_elastic.KerasState,
                             hk.elastic.run is core_elastic.run]}


def suite(backend: str) -> dict:
    import hvd_trainer

    rank, size = hvd_trainer.rank(), hvd_trainer.size()
    return {
        "bcast_local": broadcast_local_variables(rank),
        "from_config": from_config(rank),
        "partial": partial(rank, size),
        "sparse": sparse_as_dense(rank, size),
        "psets": process_sets(rank),
        "sync": state_sync_unbuilt(rank),
        "elastic": elastic_callbacks(rank),
    }

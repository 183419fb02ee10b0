"""``"auto"`` across hosts: the first optimizer steps run plain and are timed, then every front
end switches to the choice at the same step on every rank.

Two ranks on loopback with ``LOCAL_WORLD_SIZE=1``, so the world has two "hosts" (``cross_size``
2) and :class:`~hvd_trainer.comm.reduce.auto.AutoMode` measures instead of choosing at once. The
link probe and the compute timing are real; only the rule's verdict is fixed by the test
(``auto.decide`` replaced for the run: on loopback the real verdict depends on the machine's
load), and the test asserts what the rule was given (the same agreed compute on both ranks, the
probed link) and what each front end did with the verdict: the steps before it equal plain
synchronous data parallel (one process on the global batch), the steps after it run the chosen
mode (bf16 buckets: half the bytes per step; local steps: the outer loop with the user's outer
settings, against a hand-written DiLoCo reference), and the ranks end equal.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from hvd_trainer.comm.ops.compression import Compression, Compressor
from hvd_trainer.comm.reduce import auto
from hvd_trainer.comm.reduce.auto import DEFAULT_MEASURE_STEPS, DEFAULT_SKIP_STEPS, AutoChoice
from tests.dist import test_local_sgd as local_cases
from tests.multiproc import run_workers

WORLD = 2
TWO_HOSTS = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
LIGHTNING_TWO_HOSTS = {**TWO_HOSTS, "TORCHELASTIC_RUN_ID": "hvd-test"}
DECIDES_AT = DEFAULT_SKIP_STEPS + DEFAULT_MEASURE_STEPS  # the optimizer step after which it switches


@contextlib.contextmanager
def _verdict(compression: Compressor, sync_every: int | None) -> Iterator[list[dict[str, Any]]]:
    """``auto.decide`` answers ``compression`` / ``sync_every`` for a measured link and records
    its inputs (one host still gets the real rule)."""
    real, seen = auto.decide, []

    def fixed(link: Any, grad_bytes: int, *, local_steps: bool, compute_s: float) -> AutoChoice:
        if link is None:
            return real(link, grad_bytes, local_steps=local_steps, compute_s=compute_s)
        seen.append({"bytes_per_s": link.bytes_per_s, "grad_bytes": grad_bytes,
                     "local_steps": local_steps, "compute_s": compute_s})
        return AutoChoice(compression, sync_every if local_steps else None, "the test's verdict")

    auto.decide = fixed
    try:
        yield seen
    finally:
        auto.decide = real


def _check_seen(results: list[dict[str, Any]], grad_bytes: int, local_steps: bool) -> None:
    seen = [r["seen"] for r in results]
    assert [len(s) for s in seen] == [1] * WORLD, seen  # decided once per rank
    assert seen[0][0]["compute_s"] == seen[1][0]["compute_s"] > 0  # agreed: the slowest rank's
    for (s,) in seen:
        assert s["bytes_per_s"] > 0 and s["grad_bytes"] == grad_bytes and s["local_steps"] == local_steps


def _said(results: list[dict[str, Any]], line: str) -> None:
    assert line in results[0]["said"], results[0]["said"]
    assert line not in results[1]["said"]


# -- torch: DistributedOptimizer(compression="auto") and LocalSGD(sync_every="auto") ---------------
def _torch_worker() -> dict[str, Any]:
    import hvd_trainer as hvd

    rank, out = hvd.rank(), {}
    said = io.StringIO()
    with _verdict(Compression.bf16, None) as seen, contextlib.redirect_stdout(said):
        model = local_cases._model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression="auto")
        names, sent = [], []
        for step in range(DECIDES_AT + 3):
            opt.zero_grad()
            local_cases._loss(model, *local_cases._shard(step, rank)).backward()
            opt.step()
            names.append(opt.compression.name)
            sent.append(opt.wire_bytes_sent)
            if step + 1 == DECIDES_AT:
                out["plain_part"] = local_cases._flat(model).tolist()
        out["optimizer"] = {"names": names, "sent": sent, "final": local_cases._flat(model).tolist(),
                            "seen": seen, "said": said.getvalue()}
    said = io.StringIO()
    with _verdict(Compression.none, 4) as seen, contextlib.redirect_stdout(said):
        model = local_cases._model()
        opt = hvd.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, sync_every="auto",
                           outer_lr=0.5, outer_momentum=0.0, nesterov=False, sync_warmup_steps=0)
        outers, flats = [], []
        for step in range(DECIDES_AT + 8):
            opt.zero_grad()
            local_cases._loss(model, *local_cases._shard(step, rank)).backward()
            opt.step()
            c = None if opt.outer is None else opt.outer.config
            outers.append(None if c is None else [c.sync_every, c.outer_lr, c.outer_momentum, c.nesterov])
            flats.append(local_cases._flat(model).tolist())
        saved = opt.state_dict()
        resumed = hvd.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, sync_every="auto",
                               outer_lr=0.5, outer_momentum=0.0, nesterov=False, sync_warmup_steps=0)
        measuring = resumed.outer is None
        resumed.load_state_dict(saved)  # saved after auto chose: that period, no new measurement
        same_steps = resumed.state_dict()["outer"]["inner_steps"] == saved["outer"]["inner_steps"]
        out["local"] = {"outers": outers, "flats": flats, "seen": list(seen), "said": said.getvalue(),
                        "resumed": [measuring, resumed.sync_every, same_steps]}
    return out


@pytest.mark.timeout(180)
def test_torch_front_ends_measure_then_switch_at_the_same_step() -> None:
    results = run_workers(_torch_worker, WORLD, env=TWO_HOSTS, timeout_seconds=160)
    numel = sum(p.numel() for p in local_cases._model().parameters())
    plain = local_cases._single_process_sync("sgd", DECIDES_AT)

    opts = [r["optimizer"] for r in results]
    _check_seen(opts, 4 * numel, local_steps=False)
    _said(opts, "hvd_trainer: compression=auto chose compression=bf16: the test's verdict.")
    for r, o in zip(results, opts, strict=True):
        assert o["names"] == ["none"] * (DECIDES_AT - 1) + ["bf16"] * 4, o["names"]
        torch.testing.assert_close(torch.tensor(r["plain_part"]), plain, atol=1e-6, rtol=0)
        per_step = np.diff([0, *o["sent"]])
        before, after = per_step[1:DECIDES_AT].mean(), per_step[DECIDES_AT + 1:].mean()
        assert 0.45 <= after / before <= 0.6, per_step  # bf16 buckets: half the bytes
    assert opts[0]["final"] == opts[1]["final"]

    local = [r["local"] for r in results]
    _check_seen(local, 4 * numel, local_steps=True)
    _said(local, "hvd_trainer: sync_every=auto chose sync_every=4: the test's verdict.")
    for lr in local:
        assert lr["outers"] == [None] * (DECIDES_AT - 1) + [[4, 0.5, 0.0, False]] * 9, lr["outers"]
        torch.testing.assert_close(torch.tensor(lr["flats"][DECIDES_AT - 1]), plain, atol=1e-6, rtol=0)
        assert lr["resumed"] == [True, 4, True]
    a, b = (lr["flats"] for lr in local)
    assert a[DECIDES_AT + 1] != b[DECIDES_AT + 1]  # local steps: the ranks drift apart ...
    assert a[DECIDES_AT + 3] == b[DECIDES_AT + 3]  # ... until the outer step after 4 of them
    assert a[-1] == b[-1]


# -- Lightning: HorovodStrategy(sync_every="auto") and compression="auto" -------------------------
def _lightning_worker(tmp: str) -> dict[str, Any]:
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, DistributedSampler

    import hvd_trainer
    from tests.dist import test_strategy_local_steps as cases
    from tests.dist._lightning_cases import Net, make_data, trainer, weights

    out = {}
    said = io.StringIO()
    local_kwargs = {"sync_every": "auto", "sync_warmup_steps": 0}
    with _verdict(Compression.none, 2) as seen, contextlib.redirect_stdout(said):
        model = Net("sgd")
        t = cases._fit(model, DECIDES_AT + 5, local_kwargs)
        out["local"] = {"choice": t.strategy.auto_choice, "weights": weights(model), "seen": list(seen),
                        "said": said.getvalue(), "reducer": t.strategy.reducer}
    # resumed with "auto" again from a checkpoint at the end of epoch 1 (step 11, an outer step):
    # the checkpoint's period is taken up without measuring, and 2 epochs equal 2 straight ones
    epoch = DECIDES_AT + 4
    data = make_data(WORLD * 4 * epoch)
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=hvd_trainer.rank(), shuffle=False)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    with _verdict(Compression.none, 2) as seen:
        straight = Net("sgd")
        trainer(distributed=True, max_epochs=2, strategy_kwargs=local_kwargs).fit(straight, loader)
        ckpt = ModelCheckpoint(dirpath=tmp, save_on_train_epoch_end=True, save_top_k=-1)
        trainer(distributed=True, max_epochs=1, strategy_kwargs=local_kwargs, callbacks=[ckpt],
                enable_checkpointing=True).fit(Net("sgd"), loader)
        decided = len(seen)
        resumed = Net("sgd", init_seed=5)
        t = trainer(distributed=True, max_epochs=2, strategy_kwargs=local_kwargs)
        t.fit(resumed, loader, ckpt_path=ckpt.best_model_path or ckpt.last_model_path)
        out["resumed"] = {"choice": t.strategy.auto_choice, "new_decisions": len(seen) - decided,
                          "equal": bool(np.array_equal(weights(resumed), weights(straight)))}
    said = io.StringIO()
    with _verdict(Compression.bf16, None) as seen, contextlib.redirect_stdout(said):
        model = Net("sgd")
        t = cases._fit(model, DECIDES_AT + 2, {"compression": "auto"})
        out["bf16"] = {"choice": t.strategy.auto_choice, "weights": weights(model), "seen": seen,
                       "said": said.getvalue()}
    return out


@pytest.mark.timeout(240)
def test_lightning_measures_then_switches_to_local_steps_or_bf16(tmp_path) -> None:
    from tests.dist import test_strategy_local_steps as cases
    from tests.dist._lightning_cases import Net

    results = run_workers(_lightning_worker, WORLD, args=(str(tmp_path),), env=LIGHTNING_TWO_HOSTS,
                          timeout_seconds=220)
    grad_bytes = 4 * sum(p.numel() for p in Net("sgd").parameters())
    local = [r["local"] for r in results]
    _check_seen(local, grad_bytes, local_steps=True)
    _said(local, "hvd_trainer: sync_every=auto chose sync_every=2: the test's verdict.")
    # with SGD inside, a synchronous step (averaged gradient) is the warm-up's step (averaged
    # parameters): the reference's warm-up stands for the steps auto measured
    expected = cases._reference(DECIDES_AT + 5, 2, lr=0.7, mu=0.9, warmup=DECIDES_AT, inner="sgd")
    for r in local:
        assert r["choice"] == "compression=none, sync_every=2" and r["reducer"] is None
        np.testing.assert_allclose(r["weights"], expected, atol=1e-6, rtol=0)
    assert np.array_equal(local[0]["weights"], local[1]["weights"])
    for r in results:  # resumed from the checkpoint: sync_every=2 again, not measured again
        assert r["resumed"] == {"choice": "compression=none, sync_every=2", "new_decisions": 0,
                                "equal": True}, r["resumed"]
    bf16 = [r["bf16"] for r in results]
    _check_seen(bf16, grad_bytes, local_steps=False)
    _said(bf16, "hvd_trainer: compression=auto chose compression=bf16: the test's verdict.")
    assert [r["choice"] for r in bf16] == ["compression=bf16"] * WORLD
    assert np.array_equal(bf16[0]["weights"], bf16[1]["weights"])


def _keras_flat(model: Any) -> list[float]:
    return np.concatenate([np.asarray(w).ravel() for w in model.get_weights()]).tolist()


# -- Keras: DistributedOptimizer(compression="auto") and LocalSGDCallback(sync_every="auto"), both backends
def _keras_worker() -> dict[str, Any]:
    import keras

    import hvd_trainer.keras as hvd_keras

    rank = hvd_keras.rank()
    said = io.StringIO()
    with _verdict(Compression.bf16, None) as seen, contextlib.redirect_stdout(said):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, activation="tanh"),
                                  keras.layers.Dense(3)])
        opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="auto")
        model.compile(optimizer=opt, loss="mse")
        names = []
        for step in range(DECIDES_AT + 3):
            x, y = local_cases._shard(step, rank)
            model.train_on_batch(x.numpy(), y.numpy())
            names.append(opt.compression.name)
        flat = np.concatenate([np.asarray(w).ravel() for w in model.get_weights()])
    out = {"names": names, "weights": flat.tolist(), "seen": seen, "said": said.getvalue(),
           "sent": opt.wire_bytes_sent}
    said = io.StringIO()
    with _verdict(Compression.none, 4) as seen, contextlib.redirect_stdout(said):
        keras.utils.set_random_seed(rank)  # different starts: rank 0's weights are broadcast
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, activation="tanh"),
                                  keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        local = hvd_keras.callbacks.LocalSGDCallback(sync_every="auto", outer_lr=0.5, outer_momentum=0.0,
                                                     nesterov=False, sync_warmup_steps=0)
        flats, periods = [], []

        def after_batch(batch: int, logs: Any) -> None:  # runs after the LocalSGD callback's
            flats.append(_keras_flat(model))
            periods.append(local.sync_every)

        seen_weights = keras.callbacks.LambdaCallback(on_train_batch_end=after_batch)
        batches = [local_cases._shard(step, rank) for step in range(DECIDES_AT + 8)]
        x = np.concatenate([b[0].numpy() for b in batches])
        y = np.concatenate([b[1].numpy() for b in batches])
        model.fit(x, y, batch_size=len(batches[0][0]), epochs=1, shuffle=False, verbose=0,
                  callbacks=[local, seen_weights])
        saved = local.state_dict()
        resumed = hvd_keras.callbacks.LocalSGDCallback(sync_every="auto", outer_lr=0.5, outer_momentum=0.0,
                                                       nesterov=False, sync_warmup_steps=0)
        resumed.set_model(model)
        resumed.load_state_dict(saved)
        resumed.on_train_begin()  # saved after auto chose local steps: that period, no measuring
        out["local"] = {"flats": flats, "periods": periods, "seen": list(seen), "said": said.getvalue(),
                        "final": _keras_flat(model),
                        "outer": [local.outer.config.outer_lr, local.outer.config.outer_momentum,
                                  local.outer.config.nesterov],
                        "resumed": resumed.sync_every}
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_keras_measures_then_switches_to_bf16_or_local_steps(backend: str) -> None:
    env = {**TWO_HOSTS, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"}
    results = run_workers(_keras_worker, WORLD, env=env, timeout_seconds=220)
    _check_seen(results, 4 * (5 * 7 + 7 + 7 * 3 + 3), local_steps=False)
    _said(results, "hvd_trainer: compression=auto chose compression=bf16: the test's verdict.")
    for r in results:
        assert r["names"] == ["none"] * (DECIDES_AT - 1) + ["bf16"] * 4, (backend, r["names"])
        assert r["sent"] > 0
    assert results[0]["weights"] == results[1]["weights"]
    # LocalSGDCallback(sync_every="auto"): the first batches averaged (equal weights after each),
    # then local steps with the user's outer settings: apart in between, equal at each outer step
    local = [r["local"] for r in results]
    _check_seen(local, 4 * (5 * 7 + 7 + 7 * 3 + 3), local_steps=True)
    _said(local, "hvd_trainer: sync_every=auto chose sync_every=4: the test's verdict.")
    assert local[0]["periods"] == [1] * (DECIDES_AT - 1) + [4] * 9, local[0]["periods"]  # chosen at the 7th
    equal = [a == b for a, b in zip(local[0]["flats"], local[1]["flats"], strict=True)]
    assert equal == [True] * DECIDES_AT + [False, False, False, True] * 2, equal
    assert local[0]["final"] == local[1]["final"]
    assert [r["resumed"] for r in local] == [4, 4]
    assert [r["outer"] for r in local] == [[0.5, 0.0, False]] * WORLD  # the user's outer settings

"""HorovodStrategy(sync_every=H): DiLoCo local steps in a real Trainer on 2 processes.

H=1 with outer SGD lr 1 equals single-process training on the global batch; H=3 with Adam
equals a hand-written reference of the algorithm (two replicas in one process) and the ranks end
bit-identical; a checkpoint taken at an outer step carries the outer state and resumes to the
same weights as the uninterrupted run."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from tests.dist._lightning_cases import TORCHRUN_ENV, Net, fit_pair, make_data, trainer, weights
from tests.multiproc import run_workers

WORLD, B = 2, 4


def _reference(steps: int, h: int, lr: float, mu: float, tau: int = 0, warmup: int = 0,
               inner: str = "adam") -> np.ndarray:
    """DiLoCo by hand: two replicas (rank r sees samples r, r+2, ...), ``inner`` (a ``Net``
    optimizer name) each, outer
    Nesterov SGD on the mean of (anchor - replica) every h steps, and once at the end. ``tau``:
    the outer step is taken ``tau`` steps after the mean (each replica then becomes the anchor
    plus its own change since the mean was taken). ``warmup``: the first steps are each followed
    by the replicas' plain average; the h steps count from the last of them."""
    data = make_data(WORLD * B * steps)
    replicas = [Net(inner, init_seed=0), Net(inner, init_seed=0)]
    inners = [m.configure_optimizers() for m in replicas]
    anchor = [p.detach().clone() for p in replicas[0].parameters()]
    buf = [torch.zeros_like(a) for a in anchor]

    def mean_delta() -> list[torch.Tensor]:
        return [((a - list(replicas[0].parameters())[i]) + (a - list(replicas[1].parameters())[i])) / 2
                for i, a in enumerate(anchor)]

    def outer(delta: list[torch.Tensor], kept: list[list[torch.Tensor]] | None = None) -> None:
        with torch.no_grad():
            for i, a in enumerate(anchor):
                buf[i] = mu * buf[i] + delta[i]
                a -= lr * (delta[i] + mu * buf[i])
                for r, m in enumerate(replicas):
                    p = list(m.parameters())[i]
                    if kept is None:
                        p.copy_(a)
                    else:
                        p.add_(a - kept[r][i])

    launched, since = None, 0
    for step in range(steps):
        for rank, (m, o) in enumerate(zip(replicas, inners, strict=True)):
            idx = [rank + WORLD * (step * B + j) for j in range(B)]
            x, y = data.tensors[0][idx], data.tensors[1][idx]
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        if step < warmup:
            with torch.no_grad():
                for a, p0, p1 in zip(anchor, replicas[0].parameters(), replicas[1].parameters(), strict=True):
                    a -= ((a - p0) + (a - p1)) / 2
                    p0.copy_(a)
                    p1.copy_(a)
            continue
        since += 1
        if launched is not None and since == tau:
            outer(*launched)
            launched = None
        if (step + 1 - warmup) % h == 0:
            with torch.no_grad():
                if tau:
                    launched = (mean_delta(), [[p.clone() for p in m.parameters()] for m in replicas])
                else:
                    outer(mean_delta())
            since = 0
    if launched is not None and since == 0:
        outer(launched[0])
    elif launched is not None or since:
        if launched is not None:
            outer(*launched)
        with torch.no_grad():
            outer(mean_delta())
    return weights(replicas[0])


def _fit(model: Net, steps: int, strategy_kwargs: dict, **kwargs: Any) -> Any:
    import hvd_trainer

    data = make_data(WORLD * B * steps)
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=hvd_trainer.rank(), shuffle=False)
    t = trainer(distributed=True, max_steps=steps, strategy_kwargs=strategy_kwargs, **kwargs)
    t.fit(model, DataLoader(data, batch_size=B, sampler=sampler))
    return t


def _worker(tmp: str) -> dict[str, Any]:
    import hvd_trainer

    out: dict[str, Any] = {}
    sync = fit_pair(optimizer="sgd", steps=5,
                    strategy_kwargs={"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0,
                                     "sync_warmup_steps": 0})
    out["h1_diff"] = float(np.abs(sync["dist"] - sync["ref"]).max())

    model = Net("adam", init_seed=hvd_trainer.rank())
    t = _fit(model, 7, {"sync_every": 3, "sync_warmup_steps": 0})  # outer steps at 3, 6 and the end
    out["h3"] = weights(model)
    out["h3_wire"] = t.strategy.wire_bytes_sent  # read after fit: kept over the teardown
    out["numel"] = sum(p.numel() for p in model.parameters())
    out["outer_steps"] = None if t.strategy.outer is None else -1  # torn down after fit
    out["no_reducer"] = t.strategy.reducer is None

    # the outer step hidden behind one optimizer step: launched at 3 and 6, finished at 4 and 7,
    # and a blocking one at the end (a step was taken since the launch at 6)
    model = Net("adam", init_seed=hvd_trainer.rank())
    _fit(model, 7, {"sync_every": 3, "outer_overlap_steps": 1, "sync_warmup_steps": 0})
    out["h3_overlap"] = weights(model)

    # the synchronous warm-up: steps 1-2 each end with the ranks' average, outer steps at 5, 8
    # and the end
    model = Net("adam", init_seed=hvd_trainer.rank())
    _fit(model, 9, {"sync_every": 3, "sync_warmup_steps": 2})
    out["h3_warmup"] = weights(model)

    # a checkpoint at the end of epoch 1 (step 4, an outer step with sync_every=2) resumed for a
    # second epoch equals 2 straight epochs: plain SGD inside (no per-rank inner state), the
    # outer momentum restored
    kw = {"sync_every": 2, "sync_warmup_steps": 0}
    data = make_data(WORLD * B * 4)  # 4 steps per epoch
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=hvd_trainer.rank(), shuffle=False)
    loader = DataLoader(data, batch_size=B, sampler=sampler)
    straight = Net("sgd", init_seed=0)
    trainer(distributed=True, max_epochs=2, strategy_kwargs=kw).fit(straight, loader)
    ckpt = ModelCheckpoint(dirpath=os.path.join(tmp, "ckpt"), save_on_train_epoch_end=True, save_top_k=-1)
    first = Net("sgd", init_seed=0)
    trainer(distributed=True, max_epochs=1, strategy_kwargs=kw, callbacks=[ckpt],
            enable_checkpointing=True).fit(first, loader)
    path = ckpt.best_model_path or ckpt.last_model_path
    saved = torch.load(path, weights_only=False)
    extra = saved["optimizer_states"][0].get("hvd_trainer", {})
    out["ckpt_outer_steps"] = extra.get("local_steps", {}).get("outer_steps")
    resumed = Net("sgd", init_seed=5)
    trainer(distributed=True, max_epochs=2, strategy_kwargs=kw).fit(resumed, loader, ckpt_path=path)
    out["straight"] = weights(straight)
    out["resumed"] = weights(resumed)
    return out


@pytest.mark.timeout(400)
def test_local_steps_in_a_trainer(tmp_path: Any) -> None:
    results = run_workers(_worker, WORLD, args=(str(tmp_path),), env=TORCHRUN_ENV, timeout_seconds=380)
    expected = _reference(7, 3, lr=0.7, mu=0.9)
    overlapped = _reference(7, 3, lr=0.7, mu=0.9, tau=1)
    assert not np.allclose(overlapped, expected, atol=1e-6)  # the delay is visible
    warmed = _reference(9, 3, lr=0.7, mu=0.9, warmup=2)
    assert not np.allclose(warmed, _reference(9, 3, lr=0.7, mu=0.9), atol=1e-6)  # so is the warm-up
    for r in results:
        assert r["h1_diff"] <= 1e-6
        assert r["no_reducer"]
        np.testing.assert_allclose(r["h3"], expected, atol=1e-6, rtol=0)
        np.testing.assert_allclose(r["h3_overlap"], overlapped, atol=1e-6, rtol=0)
        np.testing.assert_allclose(r["h3_warmup"], warmed, atol=1e-6, rtol=0)
        # 3 outer steps, each a ring allreduce of the fp32 parameters: 2 (N-1)/N of their bytes
        assert r["h3_wire"] == 3 * 2 * (WORLD - 1) * 4 * r["numel"] // WORLD
        assert r["ckpt_outer_steps"] == 2
    assert np.array_equal(results[0]["h3"], results[1]["h3"])
    assert np.array_equal(results[0]["h3_overlap"], results[1]["h3_overlap"])
    assert np.array_equal(results[0]["h3_warmup"], results[1]["h3_warmup"])
    # the straight run's rank 0 and 1 agree, and the resumed run lands on the same weights
    assert np.array_equal(results[0]["straight"], results[1]["straight"])
    for r in results:
        np.testing.assert_array_equal(r["resumed"], r["straight"])


def test_invalid_sync_every_raises_strategy_error() -> None:
    from hvd_trainer.strategy import HorovodStrategy, StrategyConfigError

    with pytest.raises(StrategyConfigError, match="sync_every=0"):
        HorovodStrategy(sync_every=0)
    with pytest.raises(StrategyConfigError, match="outer_momentum"):
        HorovodStrategy(sync_every=4, outer_momentum=1.5)
    with pytest.raises(StrategyConfigError, match="overlap_steps=4 must be an int in"):
        HorovodStrategy(sync_every=4, outer_overlap_steps=4)
    # an outer-loop argument without local steps would be ignored: it is refused, naming it
    refused = r"^outer_lr=0.5, outer_nesterov=False set without sync_every.*HINT"
    with pytest.raises(StrategyConfigError, match=refused):
        HorovodStrategy(outer_lr=0.5, outer_nesterov=False)
    # compression="auto" alone never chooses local steps (sync_every="auto" lets it): refused too
    with pytest.raises(StrategyConfigError, match=r"^outer_lr=0.5 set without sync_every.*HINT"):
        HorovodStrategy(outer_lr=0.5, compression="auto")
    HorovodStrategy(outer_lr=0.5, sync_every="auto", compression="auto")  # kept for the local steps
    HorovodStrategy(outer_lr=0.7, outer_momentum=0.9)  # the defaults, spelled out
    with pytest.raises(StrategyConfigError, match=r"^outer_fragments=2 set without sync_every.*HINT"):
        HorovodStrategy(outer_fragments=2)
    with pytest.raises(StrategyConfigError, match=r"outer_fragments=2 with sync_every='auto'.*HINT"):
        HorovodStrategy(sync_every="auto", outer_fragments=2)
    with pytest.raises(StrategyConfigError, match=r"fragments=3 must be an int >= 1 that divides"):
        HorovodStrategy(sync_every=4, outer_fragments=3)
    assert HorovodStrategy(sync_every=8, outer_fragments=4, outer_overlap_steps=1).local_steps.fragments == 4


def _auto_worker() -> dict[str, Any]:
    import hvd_trainer

    model = Net("sgd", init_seed=hvd_trainer.rank())
    t = _fit(model, 2, {"compression": "auto", "sync_every": "auto"})
    return {"choice": t.strategy.auto_choice, "weights": weights(model), "wire": t.strategy.wire_bytes_sent,
            "numel": sum(p.numel() for p in model.parameters())}


@pytest.mark.timeout(200)
def test_auto_on_one_host_chooses_plain_allreduce() -> None:
    results = run_workers(_auto_worker, WORLD, env=TORCHRUN_ENV, timeout_seconds=180)
    assert [r["choice"] for r in results] == ["compression=none"] * WORLD
    assert np.array_equal(results[0]["weights"], results[1]["weights"])
    for r in results:  # 2 steps of gradient buckets (with their used flags), 2 (N-1)/N each
        least = 2 * 2 * (WORLD - 1) * 4 * r["numel"] / WORLD
        assert least <= r["wire"] <= 1.1 * least, (r["wire"], least)

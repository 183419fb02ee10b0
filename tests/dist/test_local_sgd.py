"""hvd.LocalSGD (DiLoCo local steps) on 2 processes over gloo: H=1 with outer SGD lr 1 equals
synchronous data parallel; H=4 equals a hand-written single-process reference of the algorithm;
the ranks' weights are bit-identical after every outer step; state_dict resumes bit-identically;
sync_every="auto" on one host says so and is synchronous data parallel (Adam inside)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.multiproc import run_workers

B = 4  # per-rank batch
WORLD = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * B, 5, generator=g), torch.randn(WORLD * B, 3, generator=g)


def _shard(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step)
    return x[rank * B : (rank + 1) * B], y[rank * B : (rank + 1) * B]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


INNER = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}


def _train_local_sgd(inner: str, steps: int, kwargs: dict) -> dict:
    import hvd_trainer as hvd

    rank = hvd.rank()
    model = _model()
    if rank == 1:  # construction broadcasts rank 0's parameters
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = hvd.LocalSGD(INNER[inner](model.parameters()), model, **kwargs)
    synced = []
    for step in range(steps):
        opt.zero_grad()
        _loss(model, *_shard(step, rank)).backward()
        opt.step()
        if opt.outer.inner_steps == 0:
            synced.append(_flat(model).clone())
    # plain lists: tensors through the result queue would need the worker alive to be read
    return {"final": _flat(model).tolist(), "synced": [s.tolist() for s in synced],
            "outer_steps": opt.outer.outer_steps, "bytes_sent": opt.wire_bytes_sent}


def _single_process_sync(inner: str, steps: int) -> torch.Tensor:
    model = _model()
    opt = INNER[inner](model.parameters())
    for step in range(steps):
        opt.zero_grad()
        _loss(model, *_batch(step)).backward()  # the mean over the global batch
        opt.step()
    return _flat(model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inner", ["sgd", "momentum"])
def test_h1_outer_sgd_lr1_equals_synchronous_data_parallel(inner: str) -> None:
    steps = 5
    results = run_workers(_train_local_sgd, WORLD, args=(inner, steps, {
        "sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "sync_warmup_steps": 0}))
    expected = _single_process_sync(inner, steps)
    for r in results:
        assert r["outer_steps"] == steps
        torch.testing.assert_close(torch.tensor(r["final"]), expected, atol=1e-6, rtol=0)
    assert results[0]["final"] == results[1]["final"]


def _int8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """One block (the model has 66 values < 256): scale absmax / 127, values rounded."""
    scale = x.abs().max() / 127.0
    return torch.round(x / scale).clamp(-127, 127) * scale


def _dilo_co_reference(steps: int, h: int, lr: float, mu: float, nesterov: bool,
                       int8: bool = False, warmup: int = 0) -> list[torch.Tensor]:
    """DiLoCo by hand in one process: two replicas with their own Adam, an explicit outer
    Nesterov SGD on the average of (anchor - replica); ``int8``: each replica's flat delta goes
    through an int8 round trip first; ``warmup``: the first steps are each followed by the
    plain average of the replicas (no outer SGD), local steps count from the last of them."""
    replicas = [_model(), _model()]
    inners = [INNER["adam"](m.parameters()) for m in replicas]
    anchor = [p.detach().clone() for p in replicas[0].parameters()]
    buf = [torch.zeros_like(a) for a in anchor]
    synced = []
    for step in range(steps):
        for rank, (m, o) in enumerate(zip(replicas, inners, strict=True)):
            o.zero_grad()
            _loss(m, *_shard(step, rank)).backward()
            o.step()
        averaged = step < warmup
        if not averaged and (step + 1 - warmup) % h:
            continue
        with torch.no_grad():
            flat = [torch.cat([(a - p).reshape(-1) for a, p in zip(anchor, m.parameters(), strict=True)])
                    for m in replicas]
            if int8:
                flat = [_int8_roundtrip(f) for f in flat]
            mean = ((flat[0] + flat[1]) / 2).split([a.numel() for a in anchor])
            for i, a in enumerate(anchor):
                ps = [list(m.parameters())[i] for m in replicas]
                delta = mean[i].view_as(a)
                if averaged:
                    a -= delta
                else:
                    buf[i] = mu * buf[i] + delta
                    update = delta + mu * buf[i] if nesterov else buf[i]
                    a -= lr * update
                for p in ps:
                    p.copy_(a)
        synced.append(torch.cat([a.reshape(-1) for a in anchor]))
    return synced


@pytest.mark.timeout(120)
def test_h4_equals_hand_written_dilo_co_and_ranks_agree_after_each_sync() -> None:
    steps, h = 12, 4
    results = run_workers(_train_local_sgd, WORLD, args=("adam", steps, {"sync_every": h,
                                                                         "sync_warmup_steps": 0}))
    expected = _dilo_co_reference(steps, h, lr=0.7, mu=0.9, nesterov=True)
    for r in results:
        assert r["outer_steps"] == steps // h
        assert len(r["synced"]) == len(expected)
        for got, want in zip(r["synced"], expected, strict=True):
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-6, rtol=0)
    for a, b in zip(results[0]["synced"], results[1]["synced"], strict=True):
        assert a == b  # bit-identical on every rank after each outer step


@pytest.mark.timeout(120)
def test_the_synchronous_warm_up_averages_each_step_then_local_steps_follow() -> None:
    """The default (no ``sync_warmup_steps`` given) is 128 averaged steps; 3 here: steps 1-3
    each end with the ranks' average, outer steps at 7, 11 and 15 (the outer SGD's momentum
    starts at the first of them)."""
    from hvd_trainer.comm.reduce.localsgd import LocalSGDConfig

    assert LocalSGDConfig(sync_every=32).sync_warmup_steps == 128
    steps, h, warmup = 16, 4, 3
    results = run_workers(_train_local_sgd, WORLD, args=("adam", steps, {"sync_every": h,
                                                                         "sync_warmup_steps": warmup}))
    expected = _dilo_co_reference(steps, h, lr=0.7, mu=0.9, nesterov=True, warmup=warmup)
    without = _dilo_co_reference(steps, h, lr=0.7, mu=0.9, nesterov=True)
    assert not torch.allclose(expected[-1], without[-1])  # the warm-up changes the trajectory
    for r in results:
        assert r["outer_steps"] == (steps - warmup) // h
        assert len(r["synced"]) == len(expected) == warmup + (steps - warmup) // h
        for got, want in zip(r["synced"], expected, strict=True):
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-6, rtol=0)
    for a, b in zip(results[0]["synced"], results[1]["synced"], strict=True):
        assert a == b  # bit-identical after each average and outer step


@pytest.mark.timeout(120)
def test_int8_outer_gradient_equals_reference_and_counts_its_bytes() -> None:
    steps, h = 12, 4
    results = run_workers(_train_local_sgd, WORLD, args=("adam", steps, {
        "sync_every": h, "compression": "int8", "sync_warmup_steps": 0}))
    expected = _dilo_co_reference(steps, h, lr=0.7, mu=0.9, nesterov=True, int8=True)
    exact = _dilo_co_reference(steps, h, lr=0.7, mu=0.9, nesterov=True)
    assert not torch.equal(expected[-1], exact[-1])  # the quantisation is visible
    for r in results:
        assert r["outer_steps"] == steps // h
        for got, want in zip(r["synced"], expected, strict=True):
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-6, rtol=0)
        # one block of 256 int8 values, its fp32 scale and the bucket's fp32 "used" flag, to the
        # one other rank, per outer step
        assert r["bytes_sent"] == (steps // h) * (256 + 4 + 4)
    for a, b in zip(results[0]["synced"], results[1]["synced"], strict=True):
        assert a == b


def _train_overlapped(steps: int, h: int, tau: int, fragments: int = 1) -> dict:
    import hvd_trainer as hvd

    rank = hvd.rank()
    model = _model()
    opt = hvd.LocalSGD(INNER["adam"](model.parameters()), model, sync_every=h, overlap_steps=tau,
                       fragments=fragments, sync_warmup_steps=0)
    seen = []
    for step in range(steps):
        opt.zero_grad()
        _loss(model, *_shard(step, rank)).backward()
        opt.step()
        seen.append((opt.outer.in_flight, opt.outer.outer_steps))
    before_sync = _flat(model).tolist()
    unsettled = opt.outer.unsettled
    opt.settle()
    after_settle = _flat(model).tolist()
    opt.settle()  # nothing left to reduce: must not move the parameters (outer momentum)
    return {"before_sync": before_sync, "final": after_settle, "seen": seen, "unsettled": unsettled,
            "outer_steps": opt.outer.outer_steps, "parts": opt.outer.parts,
            "settled_twice": _flat(model).tolist() == after_settle}


def _settle_after_a_launch(steps: int, h: int, tau: int) -> dict:
    import hvd_trainer as hvd

    rank = hvd.rank()
    model = _model()
    opt = hvd.LocalSGD(INNER["adam"](model.parameters()), model, sync_every=h, overlap_steps=tau,
                       sync_warmup_steps=0)
    for step in range(steps):
        opt.zero_grad()
        _loss(model, *_shard(step, rank)).backward()
        opt.step()
    in_flight = opt.outer.in_flight
    opt.settle()
    anchors = torch.cat([a.reshape(-1) for a in opt.outer.anchors])
    return {"in_flight": in_flight, "final": _flat(model).tolist(), "anchors": anchors.tolist(),
            "outer_steps": opt.outer.outer_steps}


@pytest.mark.timeout(120)
def test_settle_finishes_an_outer_step_launched_at_the_last_step_without_another() -> None:
    results = run_workers(_settle_after_a_launch, WORLD, args=(12, 4, 2))
    for r in results:
        assert r["in_flight"] and r["outer_steps"] == 3  # launched at 12: finished, none added
        assert r["final"] == r["anchors"]  # exactly the anchors: no inner step since the launch
    assert results[0]["final"] == results[1]["final"]


def _overlapped_reference(steps: int, h: int, tau: int, parts: list[list[int]] | None = None  # noqa: C901
                          ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The hidden outer step by hand in one process (two replicas, Adam inside, outer Nesterov
    SGD 0.7 / 0.9): after inner step ``h`` the mean of (anchor - replica) is taken and each
    replica's parameters are kept; ``tau`` inner steps later the anchor steps and each replica
    becomes anchor + (its parameters now - those kept). Then a final blocking outer step.
    ``parts`` (Streaming DiLoCo's fragments, parameter indices): the same per part, part ``k``
    of ``F`` launched after every ``h / F`` steps in turn, the others untouched.
    Returns each replica's parameters before the final step, and the parameters after it."""
    lr, mu = 0.7, 0.9
    replicas = [_model(), _model()]
    inners = [INNER["adam"](m.parameters()) for m in replicas]
    anchor = [p.detach().clone() for p in replicas[0].parameters()]
    buf = [torch.zeros_like(a) for a in anchor]

    everything = list(range(len(anchor)))
    parts = parts or [everything]

    def mean_delta(part: list[int]) -> dict[int, torch.Tensor]:
        params = [list(m.parameters()) for m in replicas]
        return {i: ((anchor[i] - params[0][i]) + (anchor[i] - params[1][i])) / 2 for i in part}

    def outer_step(delta: dict[int, torch.Tensor]) -> None:
        for i, d in delta.items():
            buf[i] = mu * buf[i] + d
            anchor[i] -= lr * (d + mu * buf[i])

    def finish(delta: dict[int, torch.Tensor], kept: list[list[torch.Tensor]]) -> None:
        outer_step(delta)
        for m, mine in zip(replicas, kept, strict=True):
            params = list(m.parameters())
            for i in delta:
                params[i].add_(anchor[i] - mine[i])

    launched = None  # (mean delta by index, each replica's parameters at the launch, steps since)
    launches = 0
    for step in range(steps):
        for rank, (m, o) in enumerate(zip(replicas, inners, strict=True)):
            o.zero_grad()
            _loss(m, *_shard(step, rank)).backward()
            o.step()
        with torch.no_grad():
            if launched is not None:
                launched[2] += 1
                if launched[2] == tau:
                    finish(*launched[:2])
                    launched = None
            if (step + 1) % (h // len(parts)) == 0:
                part = parts[launches % len(parts)]
                launches += 1
                launched = [mean_delta(part), [[p.clone() for p in m.parameters()] for m in replicas], 0]
    assert launched is None, "end the reference on a finished outer step"
    before = [_flat(m) for m in replicas]
    with torch.no_grad():
        outer_step(mean_delta(everything))
    return before, torch.cat([a.reshape(-1) for a in anchor])


@pytest.mark.timeout(120)
def test_a_hidden_outer_step_equals_the_delayed_reference_and_sync_makes_ranks_equal() -> None:
    steps, h, tau = 14, 4, 2  # launches after steps 4, 8, 12; each finished 2 steps later
    results = run_workers(_train_overlapped, WORLD, args=(steps, h, tau))
    before, final = _overlapped_reference(steps, h, tau)
    assert not torch.allclose(before[0], before[1])  # the replicas differ between outer steps
    for rank, r in enumerate(results):
        # in flight from the launch until tau inner steps later, never blocking the launch step
        assert [f for f, _ in r["seen"]] == [s % h in (0, 1) and s >= h for s in range(1, steps + 1)]
        assert r["seen"][h - 1] == (True, 0) and r["seen"][h + tau - 1] == (False, 1)
        assert r["outer_steps"] == steps // h + 1 and r["unsettled"] and r["settled_twice"]
        torch.testing.assert_close(torch.tensor(r["before_sync"]), before[rank], atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(r["final"]), final, atol=1e-6, rtol=0)
    assert results[0]["final"] == results[1]["final"]  # bit-identical after settle()


@pytest.mark.timeout(120)
def test_fragments_step_their_parts_in_turn_and_equal_the_streaming_reference() -> None:
    """Streaming DiLoCo's fragments: 2 parts (the first weight, 35 values; the rest, 31),
    ``H=4``: one part's outer step launched every 2 steps, finished 1 step later."""
    steps, h, tau, fragments = 13, 4, 1, 2  # launches after 2, 4, ..., 12; each finished 1 later
    parts = [[0], [1, 2, 3]]
    results = run_workers(_train_overlapped, WORLD, args=(steps, h, tau, fragments))
    before, final = _overlapped_reference(steps, h, tau, parts)
    whole_before, _ = _overlapped_reference(steps, h, tau)
    assert not torch.allclose(before[0], whole_before[0], atol=1e-4)  # the parts change the result
    for rank, r in enumerate(results):
        assert r["parts"] == parts
        assert [f for f, _ in r["seen"]] == [s % 2 == 0 for s in range(1, steps + 1)]
        assert r["outer_steps"] == steps // 2 + 1 and r["unsettled"] and r["settled_twice"]
        torch.testing.assert_close(torch.tensor(r["before_sync"]), before[rank], atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(r["final"]), final, atol=1e-6, rtol=0)
    assert results[0]["final"] == results[1]["final"]  # bit-identical after settle()


def _resume(save_at: int, more: int, warmup: int, fragments: int) -> tuple[torch.Tensor, torch.Tensor]:
    import hvd_trainer as hvd

    rank = hvd.rank()
    model = _model()
    opt = hvd.LocalSGD(INNER["adam"](model.parameters()), model, sync_every=4, sync_warmup_steps=warmup,
                       fragments=fragments)

    def train(m: torch.nn.Module, o: torch.optim.Optimizer, first: int, n: int) -> None:
        for step in range(first, first + n):
            o.zero_grad()
            _loss(m, *_shard(step, rank)).backward()
            o.step()

    train(model, opt, 0, save_at)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    assert set(saved_opt) == {"inner", "outer"}
    assert saved_opt["outer"]["inner_steps"] == max(0, save_at - warmup) % (4 // fragments)
    assert saved_opt["outer"]["warmup_left"] == max(0, warmup - save_at)
    train(model, opt, save_at, more)
    straight = _flat(model)

    model2 = _model()
    with torch.no_grad():
        for p in model2.parameters():
            p.mul_(3.0)  # anything: the checkpoint overwrites it
    opt2 = hvd.LocalSGD(INNER["adam"](model2.parameters()), model2, sync_every=4, sync_warmup_steps=warmup,
                        fragments=fragments)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    train(model2, opt2, save_at, more)
    return straight.tolist(), _flat(model2).tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("warmup", "fragments"), [(0, 1), (8, 1), (0, 2)])
def test_state_dict_resumes_bit_identically_mid_period(warmup: int, fragments: int) -> None:
    """Saved mid-period; mid-warm-up; with 2 parts after the first part's step (the second next)."""
    save_at = 6 if fragments == 1 else 3
    for straight, resumed in run_workers(_resume, WORLD, args=(save_at, 7, warmup, fragments)):
        assert straight == resumed


def test_invalid_settings_raise_with_a_hint() -> None:
    from hvd_trainer.comm.reduce.localsgd import LocalSGDConfig, LocalSGDConfigError

    for bad in ({"sync_every": 0}, {"sync_every": True}, {"sync_every": 2, "outer_lr": 0.0},
                {"sync_every": 2, "outer_momentum": 1.0}, {"sync_every": 2, "compression": "int3"},
                {"sync_every": 2, "compression": "powersgd:2"}, {"sync_every": 2, "overlap_steps": 2},
                {"sync_every": 2, "overlap_steps": -1}, {"sync_every": 4, "overlap_steps": 1,
                                                          "compression": "int8"},
                {"sync_every": 2, "sync_warmup_steps": -1}, {"sync_every": 2, "sync_warmup_steps": 1.5},
                {"sync_every": 4, "fragments": 3}, {"sync_every": 4, "fragments": 0},
                {"sync_every": 4, "fragments": 2, "overlap_steps": 2}):
        with pytest.raises(LocalSGDConfigError, match="HINT"):
            LocalSGDConfig(**bad)
    within = r"overlap_steps=2 must be an int in \[0, sync_every / fragments=2\)"
    with pytest.raises(LocalSGDConfigError, match=within):
        LocalSGDConfig(sync_every=4, fragments=2, overlap_steps=2)


def _refusals() -> dict:
    import hvd_trainer as hvd
    from hvd_trainer.comm.reduce.localsgd import LocalSGDConfigError

    out = {}
    for key, kwargs in {"auto": {"sync_every": "auto", "fragments": 2},
                        "more_parts_than_parameters": {"sync_every": 8, "fragments": 8}}.items():
        model = _model()  # 4 parameters
        try:
            hvd.LocalSGD(INNER["sgd"](model.parameters()), model, **kwargs)
            out[key] = None
        except LocalSGDConfigError as exc:
            out[key] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_fragments_refused_with_auto_and_beyond_the_parameter_count() -> None:
    for r in run_workers(_refusals, WORLD):
        assert "fragments=2 with sync_every='auto'" in r["auto"] and "HINT" in r["auto"]
        assert "fragments=8 for 4 floating-point parameters" in r["more_parts_than_parameters"]


def _train_auto(steps: int) -> dict:
    import contextlib
    import io

    import hvd_trainer as hvd

    rank = hvd.rank()
    model = _model()
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        opt = hvd.LocalSGD(INNER["adam"](model.parameters()), model, sync_every="auto")
    for step in range(steps):
        opt.zero_grad()
        _loss(model, *_shard(step, rank)).backward()
        opt.step()
    opt.sync()
    return {"final": _flat(model).tolist(), "said": said.getvalue(), "outer": opt.outer,
            "sync_every": opt.sync_every, "bytes_sent": opt.wire_bytes_sent,
            "numel": sum(p.numel() for p in model.parameters()),
            "state_outer": opt.state_dict()["outer"]}


@pytest.mark.timeout(120)
def test_auto_on_one_host_says_so_and_is_synchronous_data_parallel() -> None:
    steps = 5
    results = run_workers(_train_auto, WORLD, args=(steps,))
    expected = _single_process_sync("adam", steps)  # Adam on the averaged gradient, every step
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["final"]), expected, atol=1e-6, rtol=0)
        assert r["outer"] is None and r["sync_every"] == 1 and r["state_outer"] is None
        assert r["bytes_sent"] == steps * 2 * (WORLD - 1) * 4 * r["numel"] // WORLD
        line = "hvd_trainer: sync_every=auto chose no local steps: all ranks on one host: plain allreduce."
        assert (line in r["said"]) == (rank == 0), r["said"]
    assert results[0]["final"] == results[1]["final"]

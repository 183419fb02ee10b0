"""Parameters cut by elements (hvd_trainer/comm/zero/pieces.py), in one process: two "ranks"
(two copies of a model, each stepping only the pieces it owns) together give exactly the plain
torch optimizer's update, and the state dict maps pieces to and from whole parameters."""

from __future__ import annotations

import pytest
import torch

from hvd_trainer.comm.zero.pieces import Pieces, join_states, per_element
from hvd_trainer.comm.zero.plan import plan_shards

OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, amsgrad=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "asgd": lambda p: torch.optim.ASGD(p, lr=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, initial_accumulator_value=0.1),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 20), torch.nn.Tanh(), torch.nn.Linear(20, 3))


def _pieces(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, size: int
            ) -> tuple[Pieces, set[int]]:
    """The pieces of ``model`` for ``rank`` of a by-element plan (one bucket), and the indices
    of the parameters ``rank`` owns whole; state made in the optimizer's constructor (Adagrad's)
    is kept for what ``rank`` owns, as ZeroSharding does."""
    params = list(model.parameters())
    plan = plan_shards([list(range(len(params)))], [p.numel() for p in params], [4] * len(params),
                       size, split=True)
    shard = plan.buckets[0]
    entries = [(params[i], s, n, o) for i, s, n, o in
               zip(shard.params, shard.starts, shard.numels, shard.owners, strict=True)
               if n != params[i].numel()]
    pieces, whole = Pieces(entries, rank), set(plan.owned(rank))
    pieces.split_loaded(opt)
    for i, p in enumerate(params):
        if i not in whole and not pieces.is_cut(p):
            opt.state.pop(p, None)
    return pieces, whole


def _grads(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def _step_rank(model: torch.nn.Module, opt: torch.optim.Optimizer, pieces: Pieces,
               whole: set[int], step: int) -> None:
    """One step of one "rank": gradients, then the owned parameters and pieces stepped."""
    _grads(model, step)
    for i, p in enumerate(model.parameters()):  # owned by the other rank: no step (as ZeroSharding)
        if i not in whole and not pieces.is_cut(p):
            p.grad = None
    with pieces.stepping(opt):
        opt.step()
    cut = [p for p in model.parameters() if pieces.is_cut(p)]
    assert all(p.grad is not None for p in cut)  # the parameter keeps its gradient
    assert all(v.grad is None for p in cut for v, _, _ in pieces.owned_of(p))
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())


def _exchange(ref: torch.nn.Module, models: list[torch.nn.Module], cuts: list) -> None:
    """Every element from its owner to every copy; checked against the reference first."""
    for i, (q, *ps) in enumerate(zip(ref.parameters(), *(m.parameters() for m in models),
                                     strict=True)):
        merged = torch.empty_like(q).view(-1)
        for (pieces, whole), p in zip(cuts, ps, strict=True):
            if pieces.is_cut(p):
                for view, start, numel in pieces.owned_of(p):
                    merged[start : start + numel] = view
            elif i in whole:
                merged.copy_(p.detach().view(-1))
        torch.testing.assert_close(merged.view_as(q), q.detach(), rtol=0, atol=1e-6)
        with torch.no_grad():
            for p in ps:
                p.copy_(merged.view_as(p))


def _elements(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() for st in opt.state.values() for v in st.values() if v.dim() > 0)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_two_ranks_pieces_equal_the_plain_optimizer(name: str) -> None:
    size = 2
    ref = _model()
    ref_opt = OPTIMIZERS[name](ref.parameters())
    models = [_model() for _ in range(size)]
    opts = [OPTIMIZERS[name](m.parameters()) for m in models]
    cuts = [_pieces(m, o, r, size) for r, (m, o) in enumerate(zip(models, opts, strict=True))]
    assert per_element(opts[0]) and cuts[0][0]  # something is cut
    for step in range(4):
        _grads(ref, step)
        ref_opt.step()
        for model, opt, (pieces, whole) in zip(models, opts, cuts, strict=True):
            _step_rank(model, opt, pieces, whole, step)
        _exchange(ref, models, cuts)
    # per-element state: each rank holds its elements' only, together the whole
    elems = [_elements(opt) for opt in opts]
    assert sum(elems) == _elements(ref_opt) and abs(elems[0] - elems[1]) <= _elements(ref_opt) // 50

    # state dict: the pieces' states joined give the plain optimizer's state ...
    pieces_states, whole_states = {}, {}
    for opt, (pieces, whole) in zip(opts, cuts, strict=True):
        with pieces.set_aside(opt) as aside:
            sd = opt.state_dict()
            pieces_states.update(aside)
            whole_states.update({k: v for k, v in sd["state"].items() if k in whole})
    full = {**whole_states,
            **join_states(pieces_states, {k: p.shape for k, p in enumerate(ref.parameters())})}
    ref_sd = ref_opt.state_dict()["state"]
    assert sorted(full) == sorted(ref_sd)
    for k, st in ref_sd.items():
        assert sorted(full[k]) == sorted(st)
        for key, value in st.items():
            torch.testing.assert_close(full[k][key], value, rtol=0, atol=1e-6)
    # ... and a full state loaded is split into the owned pieces' states again
    for model, opt, (pieces, _) in zip(models, opts, cuts, strict=True):
        owned = [v for p in model.parameters() if pieces.is_cut(p) for v, _, _ in pieces.owned_of(p)]
        before = [{k: t.clone() for k, t in opt.state[v].items()} for v in owned]
        opt.load_state_dict(ref_opt.state_dict())
        pieces.split_loaded(opt)
        assert not any(p in opt.state for p in model.parameters() if pieces.is_cut(p))
        for view, state in zip(owned, before, strict=True):
            for key, value in state.items():
                torch.testing.assert_close(opt.state[view][key], value, rtol=0, atol=1e-6)


def test_views_follow_a_parameter_whose_storage_moved() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pieces, _ = _pieces(model, opt, 0, 2)
    _grads(model, 0)
    with pieces.stepping(opt):
        opt.step()
    cut = next(p for p in model.parameters() if pieces.is_cut(p))
    (view, start, numel), *_ = pieces.owned_of(cut)
    buffer = opt.state[view]["momentum_buffer"].clone()
    cut.data = cut.data.clone()  # new storage, as model.to(...) may give
    _grads(model, 1)
    with pieces.stepping(opt):
        opt.step()
    (moved, _, _), *_ = pieces.owned_of(cut)
    assert moved is not view and moved.data_ptr() == cut.data_ptr() + start * cut.element_size()
    assert view not in opt.state and moved in opt.state  # the state moved with the view
    expected = 0.9 * buffer + cut.grad.view(-1)[start : start + numel]
    torch.testing.assert_close(opt.state[moved]["momentum_buffer"], expected)


def test_which_optimizers_are_per_element() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert per_element(torch.optim.Adam(p)) and per_element(torch.optim.SGD(p, lr=0.1))
    assert per_element(torch.optim.Adagrad(p))  # its constructor's state is cut too
    assert not per_element(torch.optim.Adafactor(p))  # factored per matrix

    class Custom(torch.optim.SGD):
        pass

    assert not per_element(Custom(p, lr=0.1))  # defined outside torch.optim: not assumed

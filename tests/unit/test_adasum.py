"""Adasum's arithmetic (single process): closed forms of the pairwise rule and the tree order,
and the collectives that refuse it."""

from __future__ import annotations

import pytest
import torch

import hvd_trainer as hvd
from hvd_trainer.comm.ops.adasum import adasum_pair, adasum_tree
from hvd_trainer.comm.ops.ops import ReduceOp, UnsupportedOpError, to_reduce_op
from hvd_trainer.comm.ops.optimizer_args import check_optimizer_args


def _ref_pair(a: list[float], b: list[float]) -> list[float]:
    """The paper's rule written out in plain Python floats (independent of the implementation)."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na, nb = sum(x * x for x in a), sum(y * y for y in b)
    ca = 1.0 - dot / (2 * na) if na else 1.0
    cb = 1.0 - dot / (2 * nb) if nb else 1.0
    return [ca * x + cb * y for x, y in zip(a, b, strict=True)]


def test_pair_closed_forms() -> None:
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    # a=[1,0], b=[1,1]: a.b=1, |a|^2=1, |b|^2=2 -> 0.5*a + 0.75*b
    assert adasum_pair(t(1, 0), t(1, 1)).tolist() == [1.25, 0.75]
    assert adasum_pair(t(3, 0), t(0, 4)).tolist() == [3.0, 4.0]            # orthogonal: sum
    assert adasum_pair(t(2, -1), t(2, -1)).tolist() == [2.0, -1.0]          # identical: the same
    assert adasum_pair(t(0, 0), t(5, 6)).tolist() == [5.0, 6.0]             # zero adds nothing
    assert adasum_pair(t(1, 2), t(-1, -2)).tolist() == [0.0, 0.0]           # opposite: cancel
    a, b = [0.3, -1.2, 2.0], [1.1, 0.4, -0.7]
    assert adasum_pair(t(*a), t(*b)).tolist() == pytest.approx(_ref_pair(a, b), rel=1e-12)


def test_segments_get_their_own_coefficients() -> None:
    a = torch.tensor([1.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    b = torch.tensor([1.0, 2.0, 0.0, 1.0], dtype=torch.float64)
    # first tensor identical (averaged), second orthogonal (summed)
    assert adasum_pair(a, b, [(0, 2), (2, 2)]).tolist() == [1.0, 2.0, 1.0, 1.0]
    # as one tensor the coefficients mix: a.b = 5, |a|^2 = |b|^2 = 6
    whole = adasum_pair(a, b).tolist()
    pairs = zip(a.tolist(), b.tolist(), strict=True)
    assert whole == pytest.approx([(1 - 5 / 12) * (x + y) for x, y in pairs])


def test_tree_order_for_any_count() -> None:
    vs = [[1.0, 0.5], [0.2, 1.0], [-0.7, 0.3], [0.4, 0.4], [1.5, -0.2]]
    t = [torch.tensor(v, dtype=torch.float64) for v in vs]
    assert adasum_tree(t[:1]).tolist() == vs[0]
    p01, p23 = _ref_pair(vs[0], vs[1]), _ref_pair(vs[2], vs[3])
    assert adasum_tree(t[:3]).tolist() == pytest.approx(_ref_pair(p01, vs[2]))
    assert adasum_tree(t[:4]).tolist() == pytest.approx(_ref_pair(p01, p23))
    assert adasum_tree(t).tolist() == pytest.approx(_ref_pair(_ref_pair(p01, p23), vs[4]))
    # identical inputs give the input and orthogonal ones their sum, for a count that is no power of 2
    same = [torch.tensor([2.0, -3.0])] * 5
    assert adasum_tree(same).tolist() == [2.0, -3.0]
    eye = list(torch.eye(5, dtype=torch.float64) * torch.arange(1, 6).double())
    assert adasum_tree(eye).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(ValueError):
        adasum_tree([])


def test_adasum_is_an_op_where_it_runs_and_refused_elsewhere() -> None:
    assert to_reduce_op("adasum") is ReduceOp.ADASUM is hvd.Adasum
    assert check_optimizer_args(hvd.Adasum, 1, 1.0, allow_adasum=True).op is ReduceOp.ADASUM
    with pytest.raises(UnsupportedOpError, match=r"Adasum.*HINT"):
        check_optimizer_args(hvd.Adasum, 1, 1.0)          # a front end that does not run it
    with pytest.raises(UnsupportedOpError, match="reducescatter"):
        hvd.reducescatter(torch.ones(2), op=hvd.Adasum)  # refused before any process group is needed
    from hvd_trainer.comm.reduce.fusion import GradientReducer
    from hvd_trainer.comm.zero.reducer import ShardedGradientReducer
    w = [("w", torch.nn.Parameter(torch.ones(2)))]
    with pytest.raises(UnsupportedOpError, match="ZeRO stage 2"):
        ShardedGradientReducer(w, world=None, op=hvd.Adasum)  # its buckets are reduce-scattered
    with pytest.raises(ValueError, match=r"Adasum has no error feedback.*HINT"):
        GradientReducer(w, world=None, op=hvd.Adasum, compression=hvd.Compression.int8)

"""Every dtype on every collective, on 2 gloo ranks (issue 11, class 1).

gloo has no int16, uint16, uint32 or uint64 collectives; hvd_trainer widens them for the wire.
Each result must have the input's dtype and exactly the closed-form values: allreduce
(Sum / Min / Max / Average), grouped allreduce, allgather with uneven dim 0, broadcast,
alltoall with splits and reducescatter. Extremes of each integer range check Min/Max (uint64's
top bit included) and that nothing is lost in the widening.
"""

from __future__ import annotations

import torch

from tests.multiproc import run_workers

INTS = (torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64,
        torch.uint64)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
COMPLEX = (torch.complex64, torch.complex128)
ALL = (*INTS, *FLOATS, *COMPLEX, torch.bool)


def small(dtype: torch.dtype, r: int, rows: int = 2) -> torch.Tensor:
    """Rank-dependent values of ``dtype``, shape [rows, 2], small enough that sums fit."""
    if dtype == torch.bool:
        return torch.tensor([[(i + r) % 2 == 0, r == 1] for i in range(rows)])
    base = torch.tensor([[10 * i + r + 1, 2 * (r + 1)] for i in range(rows)], dtype=torch.float64)
    return torch.complex(base, -base).to(dtype) if dtype.is_complex else base.to(dtype)


def extremes(dtype: torch.dtype, r: int) -> list[int]:
    """[max - r, min + r] of an integer dtype (as Python ints)."""
    info = torch.iinfo(dtype)
    return [info.max - r, info.min + r]


def _as_list(t: torch.Tensor) -> list:
    return t.to(torch.complex128).tolist() if t.is_complex() else t.tolist()


def _run() -> dict:
    import hvd_trainer as hvd

    r = hvd.rank()
    out: dict = {}
    for d in ALL:
        res: dict = {}
        x = small(d, r)
        res["sum"] = hvd.allreduce(x, op=hvd.Sum)
        if not d.is_complex:
            res["min"] = hvd.allreduce(x, op=hvd.Min)
            res["max"] = hvd.allreduce(x, op=hvd.Max)
        if d not in (torch.bool, torch.uint64):
            res["avg"] = hvd.allreduce(x)
            res["avg_"] = hvd.allreduce_(x.clone(), None, None, hvd.Average)
        if d in INTS:
            ext = torch.tensor(extremes(d, r), dtype=d)
            res["ext_max"] = hvd.allreduce(ext, op=hvd.Max)
            res["ext_min"] = hvd.allreduce(ext, op=hvd.Min)
            res["ext_gather"] = hvd.allgather(ext)
            res["ext_bcast"] = hvd.broadcast(ext, 1)
        res["gather"] = hvd.allgather(small(d, r, rows=r + 1))  # uneven dim 0
        res["bcast"] = hvd.broadcast(x, 1)
        res["bcast_"] = hvd.broadcast_(x.clone(), 0)
        a2a, received = hvd.alltoall(small(d, r, rows=3), splits=[1, 2] if r == 0 else [2, 1])
        res["alltoall"], res["received"] = a2a, received
        res["rs"] = hvd.reducescatter(small(d, r, rows=3), op=hvd.Sum)
        out[str(d)] = {k: (str(v.dtype), _as_list(v)) for k, v in res.items()}
    grouped = hvd.grouped_allreduce([small(d, r) for d in ALL if d != torch.bool], op=hvd.Sum)
    out["grouped"] = [(str(t.dtype), _as_list(t)) for t in grouped]
    # an int16 average whose sum overflows int16 is still exact (divided in the wide dtype)
    out["int16_avg"] = hvd.allreduce(torch.tensor([30000, -30000], dtype=torch.int16)).tolist()
    return out


def _wide(d: torch.dtype) -> torch.dtype:
    """Where the test computes the closed form (exact for these small values)."""
    if d.is_complex:
        return torch.complex128
    return torch.float64 if d.is_floating_point else torch.int64


def _sum(d: torch.dtype, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a | b if d == torch.bool else (a.to(_wide(d)) + b.to(_wide(d))).to(d)


def _expected(d: torch.dtype) -> dict:
    x0, x1 = small(d, 0), small(d, 1)
    exp: dict = {"sum": _sum(d, x0, x1)}
    if not d.is_complex:
        w0, w1 = x0.to(torch.float64), x1.to(torch.float64)  # bool and small ints are exact
        exp["min"], exp["max"] = torch.minimum(w0, w1).to(d), torch.maximum(w0, w1).to(d)
    if d not in (torch.bool, torch.uint64):
        total = x0.to(_wide(d)) + x1.to(_wide(d))
        avg = torch.div(total, 2, rounding_mode="trunc") if _wide(d) == torch.int64 else total / 2
        exp["avg"] = exp["avg_"] = avg.to(d)
    if d in INTS:
        e0, e1 = extremes(d, 0), extremes(d, 1)
        exp["ext_max"] = torch.tensor([max(e0[0], e1[0]), max(e0[1], e1[1])], dtype=d)
        exp["ext_min"] = torch.tensor([min(e0[0], e1[0]), min(e0[1], e1[1])], dtype=d)
        exp["ext_gather"] = torch.tensor(e0 + e1, dtype=d)
        exp["ext_bcast"] = torch.tensor(e1, dtype=d)
    exp["gather"] = torch.cat([small(d, 0, rows=1), small(d, 1, rows=2)])
    exp["bcast"], exp["bcast_"] = x1, x0
    return exp


def test_every_dtype_on_every_collective() -> None:
    results = run_workers(_run, 2, timeout_seconds=240)
    for r, res in enumerate(results):
        for d in ALL:
            got = res[str(d)]
            for key, want in _expected(d).items():
                assert got[key] == (str(d), _as_list(want)), (r, d, key)
            three = [small(d, q, rows=3) for q in (0, 1)]
            sends = [[three[0][:1], three[0][1:]], [three[1][:2], three[1][2:]]]
            want_a2a = torch.cat([sends[0][r], sends[1][r]])
            assert got["alltoall"] == (str(d), _as_list(want_a2a)), (r, d)
            assert got["received"] == ("torch.int32", [1, 2] if r == 0 else [2, 1])
            total = _sum(d, three[0], three[1])
            block = total[:2] if r == 0 else total[2:]  # rows 3 over 2 ranks: 2, 1
            assert got["rs"] == (str(d), _as_list(block)), (r, d)
        numeric = [d for d in ALL if d != torch.bool]
        assert res["grouped"] == [(str(d), res[str(d)]["sum"][1]) for d in numeric]
        assert res["int16_avg"] == [30000, -30000]

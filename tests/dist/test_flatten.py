"""comm.ops.flatten on 2 gloo processes: every dtype of SUPPORTED_DTYPES really travels through a
flattened broadcast and allreduce (values equal the closed form, dtypes kept), and an unsupported
dtype is the same clear error on every rank, after which the ranks still agree."""

from __future__ import annotations

import torch

from tests.multiproc import run_workers


def _values(dtype: torch.dtype, r: int) -> torch.Tensor:
    """Rank-dependent values of ``dtype``, shape [2, 2]."""
    if dtype == torch.bool:
        return torch.tensor([[r == 0, r == 1], [True, False]])
    base = torch.tensor([[1, 2], [3, 4]], dtype=torch.float64) * (r + 1)
    return base.to(dtype) if not dtype.is_complex else torch.complex(base, -base).to(dtype)


def _run() -> dict:
    import hvd_trainer as hvd
    from hvd_trainer.comm.base.errors import CommTypeError
    from hvd_trainer.comm.ops.flatten import SUPPORTED_DTYPES, flat_collective, flat_collective_

    r = hvd.rank()
    dtypes = sorted(SUPPORTED_DTYPES, key=str)
    tensors = [_values(d, r) for d in dtypes] + [torch.tensor(float(r))]  # a 0-d float32 too
    flat_collective_(tensors, lambda flat: hvd.broadcast_(flat, 1), what="test broadcast")
    out: dict = {
        "broadcast": {str(d): t.tolist() for d, t in zip(dtypes, tensors, strict=False)},
        "broadcast_dtypes": [str(t.dtype) for t in tensors],
        "scalar": (tensors[-1].shape, tensors[-1].item()),
    }
    numeric = [d for d in dtypes if d != torch.bool]
    sums = flat_collective([_values(d, r) for d in numeric],
                           lambda flat: hvd.allreduce_(flat, op=hvd.Sum), what="test allreduce")
    out["sum"] = {str(d): s.to(torch.complex128).tolist() for d, s in zip(numeric, sums, strict=True)}
    out["sum_dtypes"] = [str(s.dtype) for s in sums]
    try:
        hvd.grouped_allreduce([torch.ones(2), torch.ones(2).to(torch.float8_e4m3fn)])
        out["float8"] = "no error"
    except CommTypeError as exc:
        out["float8"] = str(exc)
    out["after"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).tolist()  # still in step
    return out


def test_every_supported_dtype_travels_flattened() -> None:
    from hvd_trainer.comm.ops.flatten import SUPPORTED_DTYPES

    results = run_workers(_run, 2, timeout_seconds=120)
    dtypes = sorted(SUPPORTED_DTYPES, key=str)
    for res in results:
        for d in dtypes:
            assert res["broadcast"][str(d)] == _values(d, 1).tolist(), d  # rank 1's values
            if d != torch.bool:  # 1 * base + 2 * base
                expect = (_values(d, 0).to(torch.complex128) * 3).tolist()
                assert res["sum"][str(d)] == expect, d
        assert res["broadcast_dtypes"] == [str(d) for d in dtypes] + ["torch.float32"]
        assert res["sum_dtypes"] == [str(d) for d in dtypes if d != torch.bool]
        assert res["scalar"] == (torch.Size([]), 1.0)
        assert "grouped_allreduce: dtype torch.float8_e4m3fn cannot travel" in res["float8"], res["float8"]
        assert "HINT" in res["float8"]
        assert res["after"] == [1.0]

"""int8 block quantisation and PowerSGD's tensor math (single process, closed-form values)."""

from __future__ import annotations

import pytest
import torch

from hvd_trainer.comm.ops.compression import (
    Compression,
    CompressionError,
    Int8Compressor,
    PowerSGDCompressor,
)
from hvd_trainer.comm.reduce.compressed import int8 as q8
from hvd_trainer.comm.reduce.compressed.powersgd import initial_q, matrix_shape, orthogonalize_


def test_int8_blocks_scale_by_absmax_and_keep_zeros() -> None:
    x = torch.tensor([1.0, -0.5, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 0.0])
    q, scales = q8.quantize(x, 4)
    assert q.dtype == torch.int8 and q.numel() == 12
    torch.testing.assert_close(scales, torch.tensor([1 / 127, 0.0, 3 / 127]))
    assert q[:4].tolist() == [127, -64, 32, 0]  # -63.5 rounds half to even: -64; 31.75 -> 32
    assert q[4:8].tolist() == [0, 0, 0, 0] and q[8:10].tolist() == [127, 0]
    back = q8.dequantize(q, scales, 10)
    assert back.numel() == 10 and back[3:8].eq(0).all()
    assert (back - x).abs().max() <= scales.max() / 2 + 1e-7


def test_int8_pack_roundtrip_and_payload_bytes() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    q, s = q8.quantize(x, 256)
    extras = torch.tensor([1.0, 0.0, 1.0])
    buf = q8.pack(q, s, extras)
    assert buf.dtype == torch.uint8 and buf.numel() == q8.payload_bytes(1000, 256, 3) == 4 * 256 + 16 + 12
    q2, s2, e2 = q8.unpack(buf, 1000, 256, 3)
    assert torch.equal(q2, q) and torch.equal(s2, s) and torch.equal(e2, extras)


def test_powersgd_matrix_rule_and_orthogonalisation() -> None:
    assert matrix_shape(torch.Size([64]), 1, 0) is None  # 1-D: uncompressed
    assert matrix_shape(torch.Size([4, 4]), 2, 0) is None  # (4+4)*2 >= 16: no saving
    assert matrix_shape(torch.Size([8, 3, 3]), 1, 0) == (8, 9)  # conv kernels: dim0 x rest
    assert matrix_shape(torch.Size([32, 32]), 1, 2048) is None  # under min_compress_numel
    p = torch.randn(20, 3, generator=torch.Generator().manual_seed(1))
    orthogonalize_(p)
    torch.testing.assert_close(p.T @ p, torch.eye(3), atol=1e-5, rtol=0)
    a, b = initial_q("w", 9, 2, 0, torch.device("cpu")), initial_q("w", 9, 2, 0, torch.device("cpu"))
    assert torch.equal(a, b) and not torch.equal(a, initial_q("v", 9, 2, 0, torch.device("cpu")))


def test_resolve_accepts_error_feedback_only_when_allowed() -> None:
    assert Compression.resolve("int8", allow_error_feedback=True) is Compression.int8
    ps = Compression.resolve("powersgd:4", allow_error_feedback=True)
    assert isinstance(ps, PowerSGDCompressor) and ps.rank == 4 and ps.name == "powersgd(rank=4)"
    two = Compression.resolve(Compression.powersgd(rank=2), allow_error_feedback=True)
    assert two == PowerSGDCompressor(2)
    with pytest.raises(CompressionError, match="HINT"):
        Compression.resolve(Compression.int8)
    with pytest.raises(CompressionError, match="multiple of 4"):
        Int8Compressor(block_size=6)
    with pytest.raises(CompressionError, match="rank must be"):
        Compression.powersgd(rank=0)

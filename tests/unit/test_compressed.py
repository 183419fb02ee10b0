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


def test_reduce_with_feedback_rejects_bad_arguments_before_any_collective() -> None:
    from hvd_trainer.comm.base.errors import CommTypeError
    from hvd_trainer.comm.reduce.compressed import FeedbackState, reduce_with_feedback

    t = [("w", torch.ones(3))]
    state = FeedbackState("int8")
    with pytest.raises(CommTypeError, match="error-feedback compressor"):
        reduce_with_feedback(t, compressor=Compression.fp16, state=state)
    with pytest.raises(CommTypeError, match="op Average or Sum"):
        reduce_with_feedback(t, compressor=Compression.int8, state=state, op="max")
    with pytest.raises(CommTypeError, match="'i' has dtype torch.int64"):
        reduce_with_feedback([("i", torch.ones(3, dtype=torch.int64))], compressor="int8", state=state)
    with pytest.raises(CommTypeError, match="2 used flags for 1 tensors"):
        reduce_with_feedback(t, compressor="int8", state=state, used=[1.0, 1.0])


def test_reduce_with_feedback_in_a_world_of_one_is_the_closed_form() -> None:
    """N = 1: int8 returns dequantize(quantize(g + e)) and keeps the rest as the residual."""
    from hvd_trainer import comm
    from hvd_trainer.comm.reduce.compressed import FeedbackState, reduce_with_feedback

    was_initialized = comm.is_initialized()
    if not was_initialized:
        comm.init()
    try:
        gen = torch.Generator().manual_seed(3)
        named = [("a", torch.randn(300, generator=gen)), ("b", torch.randn(4, 5, generator=gen).double())]
        state = FeedbackState("int8")
        out, used = reduce_with_feedback(named, compressor="int8", state=state, used=[1.0, 0.0])
        assert used == [1.0, 0.0] and out[1].dtype == torch.float64 and out[1].shape == (4, 5)
        for (name, g), got in zip(named, out, strict=True):  # one bucket per dtype
            q, s = q8.quantize(g.reshape(-1).float(), 256)
            want = q8.dequantize(q, s, g.numel()).view(g.shape)
            assert torch.equal(got.float(), want) and torch.equal(state.residuals[name], g.float() - want)
        e_a = state.residuals["a"].clone()
        again, _ = reduce_with_feedback(named, compressor="int8", state=state, prescale_factor=0.5)
        x = 0.5 * named[0][1] + e_a  # the step-1 residual is added to the (prescaled) gradient
        q, s = q8.quantize(x, 256)
        assert torch.equal(again[0], q8.dequantize(q, s, 300))
        assert torch.equal(state.residuals["a"], x - again[0])
    finally:
        if not was_initialized:
            comm.shutdown()

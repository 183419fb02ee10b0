"""comm.ops.flatten: flatten -> one collective per (device, dtype) -> unflatten, one dtype set."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hvd_trainer.comm.base.errors import CommTypeError
from hvd_trainer.comm.ops.flatten import (
    SUPPORTED_DTYPES,
    WIRE_DTYPES,
    check_dtype,
    flat_collective,
    flat_collective_,
    flatten,
    from_wire,
    numpy_to_wire,
    numpy_wire_dtype,
    to_wire,
    wire_to_numpy,
)


def _mixed() -> list[torch.Tensor]:
    return [
        torch.arange(6.0).reshape(2, 3),
        torch.tensor([1, 2, 3]),
        torch.tensor(5.0),  # 0-d
        torch.ones(4, dtype=torch.float16),
        torch.tensor([[7, 8]]),
        torch.tensor([True, False]),
    ]


def test_one_collective_per_dtype_in_order_of_first_appearance() -> None:
    tensors = _mixed()
    seen: list[tuple[torch.dtype, int]] = []

    def collective(flat: torch.Tensor) -> None:
        seen.append((flat.dtype, flat.numel()))
        if flat.dtype != torch.bool:
            flat.mul_(2)

    flat_collective_(tensors, collective, what="test")
    assert seen == [(torch.float32, 7), (torch.int64, 5), (torch.float16, 4), (torch.bool, 2)]
    assert tensors[0].tolist() == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]
    assert tensors[1].tolist() == [2, 4, 6] and tensors[4].tolist() == [[14, 16]]
    assert tensors[2].shape == () and tensors[2].item() == 10.0
    assert tensors[3].tolist() == [2.0] * 4 and tensors[5].tolist() == [True, False]
    assert [t.dtype for t in tensors] == [t.dtype for t in _mixed()]  # dtypes kept


def test_out_of_place_results_are_views_and_inputs_stay() -> None:
    tensors = _mixed()
    results = flat_collective(tensors, lambda flat: flat.logical_not_() if flat.dtype == torch.bool
                              else flat.add_(1), what="test")
    for before, after, result in zip(_mixed(), tensors, results, strict=True):
        assert torch.equal(before, after)  # inputs unchanged
        assert result.shape == before.shape and result.dtype == before.dtype
        assert torch.equal(result, ~before if before.dtype == torch.bool else before + 1)
    groups = flatten(_mixed(), what="test")
    assert [g.indices for g in groups] == [(0, 2), (1, 4), (3,), (5,)]
    views = groups[0].views()
    assert views[0].data_ptr() == groups[0].flat.data_ptr()  # a view, not a copy


def test_flattening_into_a_given_buffer() -> None:
    buf = torch.full((7,), -1.0)
    requests = []

    def buffer(dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        requests.append((dtype, device.type, numel))
        return buf

    results = flat_collective([torch.ones(3), torch.zeros(2, 2)], lambda flat: None, what="t", buffer=buffer)
    assert requests == [(torch.float32, "cpu", 7)]
    assert buf.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert results[0].data_ptr() == buf.data_ptr()


def test_unsupported_dtype_is_a_clear_error_before_any_collective() -> None:
    calls = []
    tensors = [torch.ones(2), torch.ones(2).to(torch.float8_e4m3fn)]
    with pytest.raises(CommTypeError, match=r"broadcast_parameters: dtype torch.float8_e4m3fn cannot .*HINT"):
        flat_collective_(tensors, calls.append, what="broadcast_parameters")
    assert calls == []  # the float32 group was not sent either
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        with pytest.raises(CommTypeError, match=str(dtype)):
            flatten([torch.zeros(1).to(dtype)], what="t")
    assert torch.float8_e4m3fn not in SUPPORTED_DTYPES and torch.bfloat16 in SUPPORTED_DTYPES
    # the dtypes gloo lacks travel widened (issue 11): one set, with a wire dtype for each
    for dtype, wire in WIRE_DTYPES.items():
        assert dtype in SUPPORTED_DTYPES and wire in SUPPORTED_DTYPES and wire not in WIRE_DTYPES
        assert flatten([torch.zeros(3, dtype=dtype)], what="t")[0].flat.dtype == dtype


@pytest.mark.parametrize(("dtype", "hint"), [
    (torch.qint8, "HINT: torch.qint8 is a quantized dtype (integers with a scale and zero point, which a "
                  "sum would not combine): send tensor.dequantize() (float32) and quantize the result "
                  "again; to broadcast it as it is, send tensor.int_repr() (its integers) with "
                  "tensor.q_scale() and tensor.q_zero_point()."),
    (torch.quint8, "HINT: torch.quint8 is a quantized dtype"),
    (torch.float8_e4m3fn, "HINT: convert the tensor first, tensor.float() (or .bfloat16()), and back after."),
    (torch.complex32, "HINT: convert the tensor first, tensor.to(torch.complex64), and back after."),
    (torch.int4, "HINT: convert the tensor first to a dtype above, e.g. tensor.to(torch.int32)"),
])
def test_unsupported_dtype_hint_says_what_to_send(dtype: torch.dtype, hint: str) -> None:
    with pytest.raises(CommTypeError) as info:
        check_dtype(dtype, "allreduce")
    message = str(info.value)
    assert message.startswith(f"allreduce: dtype {dtype} cannot travel (the transports carry [")
    assert hint in message
    if "float" not in str(dtype):
        assert "float8" not in message  # qint8 is int8 values with a scale, not a float8


def test_wire_round_trip_is_exact_at_the_range_ends() -> None:
    for dtype in WIRE_DTYPES:
        info = torch.iinfo(dtype)
        t = torch.tensor([info.min, info.min + 1, 0, info.max - 1, info.max], dtype=dtype)
        for op in (None, "sum", "min", "max"):
            wire = to_wire(t, op)
            assert wire.dtype == WIRE_DTYPES[dtype]
            assert from_wire(wire, dtype, op).tolist() == t.tolist(), (dtype, op)
    big = torch.tensor([2**64 - 1, 2**63, 1], dtype=torch.uint64)
    flipped = to_wire(big, "max")  # signed order of the wire is the unsigned order
    assert flipped.argmax().item() == 0 and flipped.argmin().item() == 2
    assert from_wire(to_wire(torch.tensor([65535], dtype=torch.uint16)) + 1, torch.uint16).tolist() == [0]


def test_numpy_arrays_use_the_same_dtype_set() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")  # numpy's bfloat16 (installed with Keras)
    for name in ("float16", "float32", "float64", "complex64", "int8", "uint8", "int32", "int64", "bool"):
        assert numpy_wire_dtype(name) == np.dtype(name)
        tensor, _ = numpy_to_wire(np.zeros(2, dtype=name))
        assert tensor.dtype in SUPPORTED_DTYPES
    for other in ("int16", "uint16", "uint32", ml_dtypes.bfloat16):
        assert numpy_wire_dtype(other) == np.dtype("float32")


def test_numpy_round_trip_keeps_values_shape_and_dtype() -> None:
    scalar = np.array(3, dtype=np.int16)
    tensor, dtype = numpy_to_wire(scalar)
    assert tensor.shape == () and tensor.dtype == torch.float32 and dtype == np.int16
    back = wire_to_numpy(tensor, dtype)
    assert back.dtype == np.int16 and back.shape == () and int(back) == 3
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    t_bf, d_bf = numpy_to_wire(bf)
    assert t_bf.tolist() == [1.5, -2.0] and wire_to_numpy(t_bf, d_bf).dtype == bf.dtype
    plain = np.arange(4, dtype=np.float32)
    shared, _ = numpy_to_wire(plain)
    assert shared.data_ptr() == plain.ctypes.data  # no copy when none is needed
    frozen = np.arange(6, dtype=np.float32).reshape(2, 3).T
    frozen.setflags(write=False)
    copied, _ = numpy_to_wire(frozen)  # non-contiguous and read-only: copied, no torch warning
    assert copied.is_contiguous() and copied.tolist() == frozen.tolist()

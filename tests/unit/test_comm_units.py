"""Single-process checks of the comm layer's pure parts: config, compression scaling,
signature mismatch messages, the timeline file, and a world of one."""

from __future__ import annotations

import json

import pytest
import torch

from hvd_trainer.comm.base.config import CommConfig, default_fusion_threshold_bytes
from hvd_trainer.comm.ops.checks import Signature, describe_mismatch
from hvd_trainer.comm.ops.compression import Compression, fp16_scale_exponent
from hvd_trainer.comm.ops.timeline import Timeline


def test_config_reads_horovod_variables_in_one_place() -> None:
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "9",
           "HOROVOD_TIMELINE": "/tmp/t.json"}
    cfg = CommConfig.from_env(env)
    assert (cfg.stall_warning_seconds, cfg.stall_shutdown_seconds, cfg.timeline_path) == (5, 9, "/tmp/t.json")
    assert CommConfig.from_env({"HOROVOD_STALL_CHECK_DISABLE": "1"}).stall_warning_seconds == 0
    assert CommConfig.from_env(env, timeline_path="/x.json").timeline_path == "/x.json"
    assert default_fusion_threshold_bytes({"HOROVOD_FUSION_THRESHOLD": "1024"}) == 1024
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD='abc'"):
        default_fusion_threshold_bytes({"HOROVOD_FUSION_THRESHOLD": "abc"})
    with pytest.raises(ValueError, match="suspect_after_seconds"):
        CommConfig(suspect_after_seconds=0)


def test_fp16_scale_keeps_sums_finite_and_exact_powers_of_two() -> None:
    for absmax, n in ((1e6, 2), (3e38, 8), (1e-6, 3), (65504.0, 2)):
        k = fp16_scale_exponent(absmax, n)
        assert n * absmax * 2.0**k <= 2**15 and n * absmax * 2.0**k > 2**13
    assert fp16_scale_exponent(0.0, 2) == 0 and fp16_scale_exponent(float("inf"), 2) == 0


def test_compressors_round_trip() -> None:
    x = torch.tensor([1.5, -2.25, 1024.0], dtype=torch.float64)
    for comp, wire in ((Compression.fp16, torch.float16), (Compression.bf16, torch.bfloat16)):
        sent, ctx = comp.compress(x)
        assert sent.dtype == wire
        back = comp.decompress(sent, ctx)
        assert back.dtype == torch.float64 and back.tolist() == x.tolist()
    ints = torch.tensor([1, 2])
    assert Compression.fp16.compress(ints)[0] is ints
    assert Compression.none.compress(x)[0] is x


def test_mismatch_message_lists_each_rank() -> None:
    a = Signature("allreduce", "w", (("shape", [2, 3]), ("dtype", "torch.float32")))
    b = Signature("allreduce", "w", (("shape", [3, 2]), ("dtype", "torch.float32")))
    text = describe_mismatch(a, 7, [0, 1], {0: a.encode(), 1: b.encode()})
    assert "#7" in text and "'w'" in text and "rank 0 = [2, 3], rank 1 = [3, 2]" in text
    assert "dtype" not in text.split("HINT")[0]  # equal fields are not listed
    same = Signature("allreduce", "w", (("shape", (2, 3)), ("dtype", "torch.float32")))
    assert hash(a) != hash(b) and a == same and hash(a) == hash(same)


def test_timeline_is_valid_chrome_trace(tmp_path) -> None:
    path = tmp_path / "sub" / "tl.json"
    tl = Timeline(str(path), flush_every=2)
    tl.event("grad", "allreduce", 1.0, 5.0, bytes=16)
    tl.event("grad", "wait", 2.0, 5.0)
    tl.close()
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"]) for e in xs] == [("allreduce", 1.0, 4.0), ("wait", 2.0, 3.0)]
    assert xs[0]["args"] == {"tensor": "grad", "bytes": 16}
    assert any(e["ph"] == "M" and e["args"]["name"] == "grad" for e in doc["traceEvents"])


def test_world_of_one() -> None:
    import hvd_trainer as hvd

    hvd.init()
    try:
        x = torch.tensor([3.0, 4.0])
        assert hvd.allreduce(x).tolist() == [3.0, 4.0]
        assert hvd.allreduce(torch.tensor([7]), op=hvd.Average).tolist() == [7]
        assert hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum)).tolist() == [3.0, 4.0]
        assert hvd.allgather(torch.ones(0, 2)).shape == (0, 2)
        assert hvd.alltoall(torch.arange(3.0), splits=[3])[1].tolist() == [3]
        assert hvd.reducescatter(torch.arange(4.0)).tolist() == [0.0, 1.0, 2.0, 3.0]
        assert hvd.join() == 0
        param = torch.nn.Parameter(torch.ones(2, 3))  # in place into a leaf that requires grad
        assert hvd.broadcast_(param.t(), 0) is not None and param.requires_grad
        assert hvd.allreduce_(param, prescale_factor=2.0).sum().item() == 12.0
        assert hvd.ProcessSet([0]).size() == 1
        with pytest.raises(ValueError, match="outside a world of size 1"):
            hvd.ProcessSet([1])
        with pytest.raises(TypeError, match="bool"):
            hvd.allreduce(torch.tensor([True]))
        with pytest.raises(ValueError, match="splits"):
            hvd.alltoall(torch.ones(3), splits=[2])
        with pytest.raises(TypeError, match="Handle"):
            hvd.synchronize(object())
    finally:
        hvd.shutdown()

"""The Keras front end resolves ``compression=`` and checks optimizer arguments with the comm
layer's shared functions (Compression.resolve, check_optimizer_args). One subprocess on the torch
backend with a world of one, so the backend choice does not leak into other tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json
    import numpy as np
    import keras
    import hvd_trainer
    import hvd_trainer.keras as hk
    from hvd_trainer.comm.ops.compression import Compressor

    class OwnCast(Compressor):
        name = "own"
        def compress(self, tensor):
            return tensor, None

    def error(make):
        try:
            make()
        except (TypeError, ValueError) as exc:
            return [type(exc).__name__, str(exc)]
        return None

    SGD = keras.optimizers.SGD
    out = {"optimizer_ok": {}, "optimizer_bad": {}, "collective_ok": {}, "collective_bad": {}}
    for key, value in [("none", None), ("str_none", "none"), ("str_fp16", "fp16"),
                       ("str_bf16", "bf16"), ("inst_fp16", hk.Compression.fp16),
                       ("cls_fp16", hk.compression.FP16Compressor), ("str_int8", "int8"),
                       ("inst_int8", hk.Compression.int8), ("str_powersgd", "powersgd:2"),
                       ("inst_powersgd", hk.Compression.powersgd(rank=2))]:
        c = hk.DistributedOptimizer(SGD(), compression=value).compression
        out["optimizer_ok"][key] = [type(c).__name__, c.name]
    for key, value in [("str", "int4"), ("num", 16), ("own", OwnCast), ("powersgd_0", "powersgd:0")]:
        out["optimizer_bad"][key] = error(lambda v=value: hk.DistributedOptimizer(SGD(), compression=v))
    out["optimizer_bad"]["zero_stage_str"] = error(lambda: hk.DistributedOptimizer(SGD(), zero_stage="2"))
    out["optimizer_bad"]["zero_stage_3"] = error(lambda: hk.DistributedOptimizer(SGD(), zero_stage=3))
    out["optimizer_bad"]["bpps_true"] = error(
        lambda: hk.DistributedOptimizer(SGD(), backward_passes_per_step=True))
    out["optimizer_bad"]["sum_predivide"] = error(
        lambda: hk.DistributedOptimizer(SGD(), op=hk.Sum, gradient_predivide_factor=2.0))
    # error-feedback state: empty before the first step, None without it; a load must match
    out["state"] = {"int8": hk.DistributedOptimizer(SGD(), compression="int8").compression_state_dict(),
                    "fp16": hk.DistributedOptimizer(SGD(), compression="fp16").compression_state_dict()}
    saved = {"compressor": "int8", "residuals": {}, "q": {}}
    out["state_bad"] = {
        "stateless": error(lambda: hk.DistributedOptimizer(SGD()).load_compression_state_dict(saved)),
        "other": error(lambda: hk.DistributedOptimizer(SGD(), compression="powersgd:2")
                       .load_compression_state_dict(saved)),
    }
    hvd_trainer.init()  # a world of one: the collectives run
    x = np.array([1.0e5, 6.0e4, -7.0e4], dtype="float32")
    for key, value in [("none", None), ("str_fp16", "fp16"), ("inst_fp16", hk.Compression.fp16),
                       ("cls_bf16", hk.compression.BF16Compressor)]:
        got = keras.ops.convert_to_numpy(hk.allreduce(x, compression=value))
        out["collective_ok"][key] = got.tolist()
    for key, value in [("str", "int8"), ("own", OwnCast())]:
        out["collective_bad"][key] = error(lambda v=value: hk.allreduce(x, compression=v))
    print("JSON" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def result() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KERAS_BACKEND": "torch", "TF_CPP_MIN_LOG_LEVEL": "3"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                          timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON")][-1]
    return json.loads(line[4:])


def test_keras_optimizer_accepts_every_compression_form(result: dict) -> None:
    ok = result["optimizer_ok"]
    assert ok["none"] == ok["str_none"] == ["NoneCompressor", "none"]
    assert ok["str_fp16"] == ok["inst_fp16"] == ok["cls_fp16"] == ["FP16Compressor", "fp16"]
    assert ok["str_bf16"] == ["BF16Compressor", "bf16"]
    assert ok["str_int8"] == ok["inst_int8"] == ["Int8Compressor", "int8"]
    assert ok["str_powersgd"] == ok["inst_powersgd"] == ["PowerSGDCompressor", "powersgd(rank=2)"]


def test_keras_optimizer_error_feedback_state_api(result: dict) -> None:
    assert result["state"] == {"int8": {"compressor": "int8", "residuals": {}, "q": {}, "reductions": {},
                                        "unseen_reductions": 0},
                               "fp16": None}
    bad = result["state_bad"]
    assert bad["stateless"][0] == "DistributedOptimizerError"
    assert "compression=Compression.none" in bad["stateless"][1] and "'int8'" in bad["stateless"][1]
    assert bad["other"][0] == "ValueError" and "saved with compression 'int8'" in bad["other"][1]
    assert "HINT" in bad["other"][1]


def test_keras_optimizer_rejects_bad_arguments_at_construction(result: dict) -> None:
    bad = result["optimizer_bad"]
    for key in bad:
        assert bad[key] is not None and bad[key][0] == "DistributedOptimizerError", (key, bad[key])
        assert "HINT" in bad[key][1], key
    assert bad["str"][1] == (
        "compression='int4' is not a compressor. HINT: use one of 'none', 'fp16', 'bf16', 'int8', "
        "'powersgd', 'powersgd:R' (R >= 1, e.g. 'powersgd:4') or 'auto', or a Compressor such as "
        "hvd_trainer.Compression.fp16.")
    assert bad["zero_stage_str"][1] == ("zero_stage must be an int 0, 1 or 2, got the str '2'. "
                                        "HINT: zero_stage=2 (an int).")
    assert bad["zero_stage_3"][1].startswith("zero_stage=3 must be 0 (no sharding), 1 (optimizer state ")
    assert "HINT: ZeRO stage 3 (sharded weights) is not implemented" in bad["zero_stage_3"][1]
    assert "compression='powersgd:0': expected 'powersgd' or 'powersgd:R'" in bad["powersgd_0"][1]
    assert "compression=16 is not a compressor" in bad["num"][1]
    assert "overrides compress()" in bad["own"][1]
    assert "backward_passes_per_step=True must be an int >= 1" in bad["bpps_true"][1]
    assert "needs op=Average, got op=Sum" in bad["sum_predivide"][1]


def test_keras_collectives_resolve_compression(result: dict) -> None:
    ok = result["collective_ok"]
    assert ok["none"] == [1.0e5, 6.0e4, -7.0e4]
    # a world of one: the fp16 wire keeps 1e5 (beyond fp16's 65504) finite thanks to the scale
    for key in ("str_fp16", "inst_fp16", "cls_bf16"):
        for got, want in zip(ok[key], ok["none"], strict=True):
            assert abs(got - want) <= 1e-2 * abs(want), (key, got, want)
    bad = result["collective_bad"]
    assert bad["str"][0] == "KerasCollectiveError" and "compression='int8'" in bad["str"][1]
    assert bad["own"][0] == "KerasCollectiveError" and "overrides compress()" in bad["own"][1]

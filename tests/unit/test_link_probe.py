"""Link-aware bucket caps: when they apply (FusionConfig resolution) and the cap arithmetic.
The probe itself runs across namespace hosts in tests/multihost/test_lab.py."""

from __future__ import annotations

import pytest

from hvd_trainer.comm.reduce.fusion import FusionConfig
from hvd_trainer.comm.reduce.link_probe import LinkEstimate, bucket_cap_bytes

MIB = 2**20


def test_link_aware_only_when_no_cap_was_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    monkeypatch.delenv("HOROVOD_AUTOTUNE", raising=False)
    cfg = FusionConfig()
    assert cfg.link_aware is True
    assert (cfg.fusion_threshold_bytes, cfg.first_bucket_bytes) == (16 * MIB, MIB)
    assert FusionConfig(fusion_threshold_bytes=4 * MIB).link_aware is False
    assert FusionConfig(first_bucket_bytes=MIB).link_aware is False
    assert FusionConfig(autotune=True).link_aware is False
    assert FusionConfig(link_aware=False).link_aware is False
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(8 * MIB))
    cfg = FusionConfig()
    assert (cfg.link_aware, cfg.fusion_threshold_bytes) == (False, 8 * MIB)


def test_bucket_seconds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_seconds=0"):
        FusionConfig(bucket_seconds=0)


@pytest.mark.parametrize(("bytes_per_s", "expected"), [
    (2.4e6, 256 * 1024),         # 20 Mbit/s: 120 kB -> the floor
    (12e6, 600_000),             # 100 Mbit/s: 0.05 s of wire
    (118e6, 5_900_000),          # 1 Gbit/s
    (5e9, 16 * MIB),             # loopback-fast: the configured cap
])
def test_bucket_cap_is_time_on_the_wire(bytes_per_s: float, expected: int) -> None:
    link = LinkEstimate(bytes_per_s=bytes_per_s, latency_s=1e-4)
    assert bucket_cap_bytes(link, 0.05, 256 * 1024, 16 * MIB) == expected

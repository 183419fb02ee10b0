"""Link-aware bucket caps: when they apply (FusionConfig resolution) and the cap arithmetic.
The probe itself runs across namespace hosts in tests/multihost/test_lab.py."""

from __future__ import annotations

import pytest

from hvd_trainer.comm.reduce.fusion import FusionConfig
from hvd_trainer.comm.reduce.link_probe import LinkEstimate, bucket_cap_bytes, fit_link

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


def test_fit_through_two_points_gives_the_links_rate_and_latency() -> None:
    # 12 MB/s and 1 ms: 8 KiB in 1.68 ms, 256 KiB in 22.8 ms
    link = fit_link(1e-3 + 8192 / 12e6, 1e-3 + 262144 / 12e6)
    assert link.bytes_per_s == pytest.approx(12e6)
    assert link.latency_s == pytest.approx(1e-3)


@pytest.mark.parametrize("t_small", [0.03, 0.0228])  # the small one delayed past / up to the large one
def test_a_disturbed_small_timing_gives_the_large_ones_rate_not_an_unbounded_one(t_small: float) -> None:
    link = fit_link(t_small, 0.0228)
    assert link.bytes_per_s == pytest.approx(262144 / 0.0228)
    assert link.latency_s == 0.0


def test_fit_rejects_points_it_cannot_fit() -> None:
    with pytest.raises(ValueError, match="large_bytes > small_bytes"):
        fit_link(0.001, 0.0)
    with pytest.raises(ValueError, match="large_bytes > small_bytes"):
        fit_link(0.001, 0.002, small_bytes=4096, large_bytes=4096)

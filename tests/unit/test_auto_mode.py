"""comm.reduce.auto.decide: the slow-link choice from a measured link (closed-form cases)."""

from __future__ import annotations

from hvd_trainer.comm.ops.compression import Compression
from hvd_trainer.comm.reduce.auto import AutoChoice, decide
from hvd_trainer.comm.reduce.link_probe import LinkEstimate

MIB = 2**20


def test_one_host_is_plain_allreduce_without_a_probe() -> None:
    got = decide(None, 100 * MIB, local_steps=True)
    assert got == AutoChoice(Compression.none, None, "all ranks on one host: plain allreduce")


def test_fast_link_is_plain_allreduce() -> None:
    ten_gbit = LinkEstimate(bytes_per_s=1.25e9, latency_s=1e-4)
    got = decide(ten_gbit, 4 * MIB, local_steps=True)  # 3.5 ms on the wire
    assert got.compression is Compression.none and got.sync_every is None
    assert "plain allreduce" in got.reason


def test_bf16_when_halving_the_bytes_fits_the_budget() -> None:
    link = LinkEstimate(bytes_per_s=100e6, latency_s=0.0)  # 800 Mbit/s
    got = decide(link, 8 * MIB, local_steps=False)  # 84 ms fp32, 42 ms bf16
    assert got.compression is Compression.bf16 and got.sync_every is None


def test_slow_link_powersgd_or_local_steps() -> None:
    twenty_mbit = LinkEstimate(bytes_per_s=2.5e6, latency_s=0.001)
    ps = decide(twenty_mbit, 4 * MIB, local_steps=False)  # 1.68 s per fp32 allreduce
    assert ps.compression.name == "powersgd(rank=16)" and ps.sync_every is None
    local = decide(twenty_mbit, 4 * MIB, local_steps=True)
    assert local.compression is Compression.none and local.sync_every == 64  # 1.68 / 0.05 = 33.6 -> 64
    huge = decide(twenty_mbit, 1024 * MIB, local_steps=True)
    assert huge.sync_every == 128  # capped

"""comm.reduce.auto.decide: the slow-link choice from a measured link and compute (closed-form cases)."""

from __future__ import annotations

import dataclasses

import pytest

import hvd_trainer as hvd
from hvd_trainer.comm.ops.compression import Compression
from hvd_trainer.comm.ops.process_set import resolve_set
from hvd_trainer.comm.reduce.auto import AutoChoice, AutoMode, decide
from hvd_trainer.comm.reduce.link_probe import LinkEstimate

MIB = 2**20


def test_one_host_is_plain_allreduce_without_a_probe() -> None:
    got = decide(None, 100 * MIB, local_steps=True, compute_s=0.0)
    assert got == AutoChoice(Compression.none, None, "all ranks on one host: plain allreduce")


def test_fast_link_is_plain_allreduce_when_backward_hides_it() -> None:
    ten_gbit = LinkEstimate(bytes_per_s=1.25e9, latency_s=1e-4)
    got = decide(ten_gbit, 4 * MIB, local_steps=True, compute_s=0.010)  # 3.5 ms <= 10 ms / 2
    assert got.compression is Compression.none and got.sync_every is None
    assert "plain allreduce" in got.reason and "a step computes 0.010 s" in got.reason


def test_the_same_link_is_slow_for_a_step_that_computes_little() -> None:
    """The choice depends on the compute, not only on the link: 3.5 ms on the wire is hidden by
    a 10 ms step, half-hidden by a 5 ms one (bf16) and not by a 1 ms one (PowerSGD)."""
    ten_gbit = LinkEstimate(bytes_per_s=1.25e9, latency_s=1e-4)
    assert decide(ten_gbit, 4 * MIB, local_steps=False, compute_s=0.005).compression is Compression.bf16
    fast_step = decide(ten_gbit, 4 * MIB, local_steps=False, compute_s=0.001)
    assert fast_step.compression.name == "powersgd(rank=16)"


def test_bf16_when_halving_the_bytes_hides_them() -> None:
    link = LinkEstimate(bytes_per_s=100e6, latency_s=0.0)  # 800 Mbit/s
    got = decide(link, 8 * MIB, local_steps=False, compute_s=0.1)  # 84 ms fp32 > 50, 42 ms bf16 <= 50
    assert got.compression is Compression.bf16 and got.sync_every is None


def test_slow_link_powersgd_or_local_steps() -> None:
    twenty_mbit = LinkEstimate(bytes_per_s=2.5e6, latency_s=0.001)
    ps = decide(twenty_mbit, 4 * MIB, local_steps=False, compute_s=0.06)  # 1.68 s per fp32 allreduce
    assert ps.compression.name == "powersgd(rank=16)" and ps.sync_every is None
    local = decide(twenty_mbit, 4 * MIB, local_steps=True, compute_s=0.06)
    # t / (c / 5) = 1.679 / 0.012 = 140 -> 256, capped at 128
    assert local.compression is Compression.none and local.sync_every == 128
    slower_step = decide(twenty_mbit, 4 * MIB, local_steps=True, compute_s=0.5)
    assert slower_step.sync_every == 32  # 1.679 / 0.1 = 16.8 -> 32
    assert "an outer step every 32 steps" in slower_step.reason


def test_choice_line_names_only_what_was_asked() -> None:
    choice = AutoChoice(Compression.bf16, 32, "a reason")
    line = choice.line({"compression": True})
    assert line == "hvd_trainer: compression=auto chose compression=bf16: a reason."
    assert choice.line({"compression": True, "sync_every": True}) == (
        "hvd_trainer: compression=auto and sync_every=auto chose compression=bf16, sync_every=32: a reason.")
    none = AutoChoice(Compression.none, None, "r")
    assert none.line({"sync_every": True}) == "hvd_trainer: sync_every=auto chose no local steps: r."


THREE_FRONT_ENDS = """
import os
os.environ["KERAS_BACKEND"] = "torch"
import keras, numpy as np, torch
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset
import hvd_trainer as hvd
import hvd_trainer.keras as hvd_keras
from hvd_trainer.strategy import HorovodStrategy

print("== torch", flush=True)
hvd.init()
model = torch.nn.Linear(3, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), compression="auto")
model(torch.ones(2, 3)).sum().backward()
opt.step()
print(opt.compression.name)

print("== keras", flush=True)
k = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
k.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="auto"), loss="mse")
k.fit(np.ones((4, 3), "float32"), np.ones((4, 1), "float32"), epochs=1, verbose=0)
hvd.shutdown()

print("== lightning", flush=True)
class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = pl.Trainer(strategy=HorovodStrategy(compression="auto"), accelerator="cpu", devices=1, max_steps=1,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(Tiny(), DataLoader(TensorDataset(torch.ones(4, 3)), batch_size=2))
"""


def test_every_front_end_announces_auto_with_the_same_line() -> None:
    """torch ``DistributedOptimizer``, Keras ``DistributedOptimizer`` and the Lightning strategy
    each print one line on stdout (rank 0) when ``compression="auto"`` chose."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "HOROVOD_RANK", "HOROVOD_SIZE", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
            "SLURM_PROCID")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", THREE_FRONT_ENDS], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = "hvd_trainer: compression=auto chose compression=none: all ranks on one host: plain allreduce."
    sections = proc.stdout.split("== ")[1:]
    assert [s.split()[0] for s in sections] == ["torch", "keras", "lightning"], proc.stdout
    for section in sections:
        assert section.count(line) == 1, (section, proc.stderr[-2000:])


def test_local_steps_chosen_by_auto_keep_the_users_outer_optimizer() -> None:
    """``sync_every="auto"`` picks H from the link; the outer lr, momentum, Nesterov and the
    outer gradient's compression stay what the user passed (they were dropped before)."""
    from hvd_trainer.strategy import HorovodStrategy

    slow = decide(LinkEstimate(bytes_per_s=2.5e6, latency_s=1e-3), 40 * 2**20, local_steps=True,
                  compute_s=0.1)
    assert slow.sync_every is not None
    for compression, outer_wire in (("auto", Compression.none), ("bf16", Compression.bf16)):
        strategy = HorovodStrategy(sync_every="auto", compression=compression, outer_lr=0.5,
                                   outer_momentum=0.0, outer_nesterov=False)
        strategy._sync.adopt(slow)  # what fit does with the measured link's choice
        local = strategy.local_steps
        assert (local.sync_every, local.outer_lr, local.outer_momentum, local.nesterov) == \
            (slow.sync_every, 0.5, 0.0, False)
        assert local.compression is outer_wire


def test_auto_mode_times_each_step_as_its_interval_less_its_waits() -> None:
    """Across hosts (a world of one told it spans 2 hosts): steps after ``skip_steps`` are timed
    as the time since the last step less the time spent in ``waiting()``; at the last timed step
    the rule gets their median, once."""
    world = dataclasses.replace(hvd.init(), cross_size=2)
    try:
        pset = resolve_set(None, world, "test")
        ticks = iter([0.0, 0.5, 0.8, 1.0, 1.1, 1.2, 1.5])
        given = []

        def rule(link, grad_bytes, compute_s):
            given.append((link.bytes_per_s > 0, grad_bytes, compute_s))
            return AutoChoice(Compression.bf16, None, "r")

        mode = AutoMode(world, pset, world.device, 1000, asked={"compression": True}, skip_steps=1,
                        measure_steps=2, rule=rule, clock=lambda: next(ticks))
        assert mode.measuring and mode.step_end(world) is None  # t=0: not timed (skipped)
        with mode.waiting():  # 0.5 -> 0.8
            pass
        assert mode.step_end(world) is None  # t=1.0: 1.0 - 0.3 waited = 0.7
        with mode.waiting():  # 1.1 -> 1.2
            pass
        choice = mode.step_end(world)  # t=1.5: 0.5 - 0.1 = 0.4; median 0.55
        assert choice is not None and choice.compression is Compression.bf16 and not mode.measuring
        assert mode.compute_samples == pytest.approx([0.7, 0.4])
        assert given == [(True, 1000, pytest.approx(0.55))]
        assert mode.step_end(world) is None and len(given) == 1  # decided once
        with pytest.raises(ValueError, match="measure_steps >= 1"):
            AutoMode(world, pset, world.device, 1000, asked={}, measure_steps=0)
        one_host = AutoMode(dataclasses.replace(world, cross_size=1), pset, world.device, 1000,
                            asked={"compression": True}, rule=rule)
        assert one_host.choice == decide(None, 1000, local_steps=False, compute_s=0.0) and len(given) == 1
    finally:
        hvd.shutdown()

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

    slow = decide(LinkEstimate(bytes_per_s=2.5e6, latency_s=1e-3), 40 * 2**20, local_steps=True)
    assert slow.sync_every is not None
    for compression, outer_wire in (("auto", Compression.none), ("bf16", Compression.bf16)):
        strategy = HorovodStrategy(sync_every="auto", compression=compression, outer_lr=0.5,
                                   outer_momentum=0.0, outer_nesterov=False)
        strategy._apply_auto(slow)  # what fit does with the measured link's choice
        local = strategy._local
        assert (local.sync_every, local.outer_lr, local.outer_momentum, local.nesterov) == \
            (slow.sync_every, 0.5, 0.0, False)
        assert local.compression is outer_wire

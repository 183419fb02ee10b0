"""comm.base.store: non-blocking reads of the job's store, and one key prefix per init()."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from hvd_trainer.comm.base import store as store_module
from hvd_trainer.comm.base.store import default_store, generation_store, try_get
from hvd_trainer.comm.world.world import free_port


def test_try_get_never_blocks_nor_creates_the_key() -> None:
    store = dist.HashStore()
    assert try_get(store, "missing") is None
    assert not store.check(["missing"])  # the probe left nothing behind
    store.set("present", "value")
    assert try_get(store, "present") == "value"
    store.delete_key("present")
    assert try_get(store, "present") is None


def test_no_default_store_before_init() -> None:
    assert not dist.is_initialized() and default_store() is None


def test_each_init_reads_the_agent_store_under_its_own_prefix(monkeypatch) -> None:
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # torchrun's agent
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    before = store_module._generation  # inits that already ran in this process
    first = generation_store(0, 1, timedelta(seconds=30))
    first.set("hvd/proc/0", "old")
    second = generation_store(0, 1, timedelta(seconds=30))  # as after shutdown() then init()
    assert try_get(second, "hvd/proc/0") is None  # the first group's keys are invisible
    second.set("hvd/proc/0", "new")
    assert try_get(first, "hvd/proc/0") == "old"
    assert agent.get(f"hvd_trainer/{before + 1}/hvd/proc/0") == b"old"
    assert agent.get(f"hvd_trainer/{before + 2}/hvd/proc/0") == b"new"

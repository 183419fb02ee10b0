"""The job's key-value store: where it comes from and how the comm layer reads it.

Cross-rank checks (:mod:`~hvd_trainer.comm.ops.checks`), the join protocol
(:mod:`~hvd_trainer.comm.world.join_board`), dead-rank detection (:mod:`~hvd_trainer.comm.world.liveness`) and
``is_homogeneous`` all talk through the ``torch.distributed`` store of the default process group.
This module is the bottom of those: it imports nothing of hvd_trainer.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hvd_trainer.comm.base._torch_compat import default_store as _torch_default_store

__all__ = ["default_store", "try_get", "generation_store", "raw_job_store"]

_ABSENT = "\x00hvd-absent\x00"

_generation = 0
"""How many stores :func:`generation_store` has opened in this process (one per ``init``)."""

_latest: Any = None
"""The store :func:`generation_store` opened last, kept until the next one is open. torch's
``env://`` store is multi-tenant (one server per port and process, shared by the stores open
on it), so keeping one store open keeps rank 0's server listening across ``shutdown()`` /
``init()``: the other ranks never race a closing server, and no socket is kept per ``init``."""


def default_store() -> Any:
    """The key-value store of the default process group (``None`` before init)."""
    if not dist.is_initialized():
        return None
    return _torch_default_store()


def try_get(store: Any, key: str) -> str | None:
    """Read ``key`` without blocking: ``None`` when absent. One atomic round trip
    (``compare_set`` with a sentinel never creates the key), so a key deleted between an
    existence check and a ``get`` cannot block the reader."""
    value = store.compare_set(key, _ABSENT, _ABSENT)
    text = value.decode() if isinstance(value, bytes) else str(value)
    return None if text == _ABSENT else text


def generation_store(rank: int, size: int, timeout: timedelta) -> dist.Store:
    """The job's store (``env://`` rendezvous) under a prefix unique to this ``init`` call.

    A launcher's store (torchrun's agent) outlives ``shutdown()``: without a fresh prefix a
    second ``init()`` in the same job would find the first process group's keys there and
    connect to its closed gloo addresses (or read stale cross-rank check entries). Every rank
    calls ``init``/``shutdown`` the same number of times, so the prefixes agree.

    Args:
        rank: this process's global rank. size: the world size.
        timeout: how long a store operation may wait for the other ranks.
    """
    global _generation, _latest
    _generation += 1
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=size, timeout=timeout))
    store.set_timeout(timeout)
    _latest = store  # the previous one closes now; the server it shared stays up
    return dist.PrefixStore(f"hvd_trainer/{_generation}", store)


def raw_job_store(rank: int, size: int, timeout: timedelta) -> dist.Store:
    """The job's store (``env://``: torchrun's agent store under hvdrun) without a prefix, kept
    open for the process's life: in-process recovery's membership rounds live there, across
    every process group this process builds."""
    global _latest
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=size, timeout=timeout))
    store.set_timeout(timeout)
    _latest = store
    return store

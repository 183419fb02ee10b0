"""Python objects over the collectives: ``broadcast_object`` and ``allgather_object`` (pickled
bytes travel as uint8 tensors, their lengths as int64 tensors, on the CPU group)."""

from __future__ import annotations

import pickle
from typing import Any

import torch

from hvd_trainer.comm.ops.collectives import allgather, broadcast_
from hvd_trainer.comm.ops.process_set import ProcessSet, resolve_set
from hvd_trainer.comm.world.world import World

__all__ = ["broadcast_object", "allgather_object"]


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet | None = None,
    *, world: World | None = None,
) -> Any:
    """Return ``root_rank``'s ``obj`` (pickled) on every member."""
    pset = resolve_set(process_set, world, "broadcast_object")
    me = pset.global_rank
    payload = pickle.dumps(obj) if me == root_rank else b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    broadcast_(length, root_rank, f"{name or 'object'}.length", pset)
    data = torch.zeros(int(length.item()), dtype=torch.uint8)
    if me == root_rank:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    broadcast_(data, root_rank, f"{name or 'object'}.bytes", pset)
    return obj if me == root_rank else pickle.loads(data.numpy().tobytes())


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet | None = None, *,
    world: World | None = None,
) -> list[Any]:
    """Return the list of every member's ``obj`` (pickled), in rank order."""
    pset = resolve_set(process_set, world, "allgather_object")
    payload = pickle.dumps(obj)
    lengths = allgather(torch.tensor([len(payload)], dtype=torch.int64), f"{name or 'object'}.length", pset)
    data = allgather(torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else
                     torch.zeros(0, dtype=torch.uint8), f"{name or 'object'}.bytes", pset)
    out, start = [], 0
    for n in lengths.tolist():
        out.append(pickle.loads(data[start : start + n].numpy().tobytes()))
        start += n
    return out

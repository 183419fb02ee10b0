"""Make model parameters and optimizer state equal on every rank (Horovod's
``broadcast_parameters`` / ``broadcast_optimizer_state``).

Tensors travel as in-place broadcasts packed into one flat buffer per (device, dtype), so a
model costs a handful of collectives, not one per tensor. Everything that is not a tensor
(hyperparameters such as ``lr``, ``betas``, ``momentum``; non-tensor state) is pickled from the
root, so its Python type is kept (tuples stay tuples, ints stay ints).

No optimizer step is run: a rank whose optimizer has no state yet gets empty tensors shaped
like the root's and receives their values, so the next step computes exactly what the root's
optimizer would compute, and a fresh optimizer stays fresh (Horovod's zero-gradient step gives
Adam a ``step`` of 1 and SGD a momentum buffer of ``weight_decay * p`` before training starts,
horovod/horovod#2805).

Before any value travels, the ranks agree on what they send: the names, shapes and dtypes of
the tensors (the parameters of the optimizer's groups), compared with the root's. A model that
differs between ranks raises ``ValueError`` on every rank, naming the first tensor that differs
and its shape on each rank, instead of copying the root's values into tensors of another layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hvd_trainer.comm import (
    World,
    allgather_object,
    broadcast_,
    broadcast_object,
    flat_collective_,
    get_world,
)

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_tensors_"]


def _check_root(root_rank: int, world: World) -> None:
    if not isinstance(root_rank, int) or not 0 <= root_rank < world.size:
        raise ValueError(
            f"root_rank={root_rank!r} is not a rank of a world of size {world.size}. "
            "HINT: use root_rank=0."
        )


Layout = list[tuple[str, tuple[int, ...], str]]
"""(name, shape, dtype) of each tensor a rank is about to send or receive, in order."""


def _first_difference(mine: Layout | str, root: Layout | str, root_rank: int,
                      compare_names: bool) -> str | None:
    """How this rank's layout differs from the root's (its first differing entry), or None.
    A ``str`` layout is a rank's own argument error."""
    if isinstance(mine, str):
        return mine
    if isinstance(root, str):
        return None  # the root's own verdict says why
    for i, (a, b) in enumerate(zip(mine, root, strict=False)):
        if (a if compare_names else a[1:]) != (b if compare_names else b[1:]):
            return (f"tensor #{i} is {a[0]!r} {list(a[1])} {a[2]} here, {b[0]!r} {list(b[1])} {b[2]} "
                    f"on rank {root_rank}")
    if len(mine) != len(root):
        return f"{len(mine)} tensors here, {len(root)} on rank {root_rank}"
    return None


def _agree_on_layout(layout: Layout | Exception, root_rank: int, what: str, *, world: World,
                    compare_names: bool = True) -> None:
    """Raise on every rank unless every rank's ``layout`` equals the root's.

    Two small object collectives: the root's layout goes out, and each rank's verdict (None,
    or its first difference) comes back, so every rank raises the same error. A rank whose
    own arguments were wrong passes its exception as ``layout``: it still takes its turn (so
    no peer waits in a broadcast it never joins), re-raises that exception, and the others
    raise ``ValueError`` naming it.

    Args:
        compare_names: names must match too (a state_dict's keys); else only shapes, dtypes
            and count (an optimizer's parameters, named or not), the names only say which.

    Raises:
        ValueError: some rank's tensors differ from the root's in name, shape, dtype or count.
    """
    mine: Layout | str = f"{type(layout).__name__}: {layout}" if isinstance(layout, Exception) else layout
    root = broadcast_object(mine if world.rank == root_rank else None, root_rank,
                            name=f"{what}.layout", world=world)
    verdicts = allgather_object(_first_difference(mine, root, root_rank, compare_names),
                                name=f"{what}.verdict", world=world)
    if isinstance(layout, Exception):
        raise layout
    wrong = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if wrong:
        detail = "; ".join(f"rank {r}: {v}" for r, v in wrong)
        raise ValueError(
            f"{what}: the ranks' models differ, so rank {root_rank}'s values cannot be copied "
            f"({detail}). Nothing was changed. HINT: build the same model (and optimizer) on every "
            "rank, from the same configuration, before broadcasting."
        )


def _layout(named: list[tuple[str, torch.Tensor]]) -> Layout:
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in named]


def broadcast_tensors_(tensors: list[torch.Tensor], root_rank: int, *, world: World) -> None:
    """Overwrite every tensor with ``root_rank``'s values, in place.

    Tensors are grouped by (device, dtype) and each group is sent as one flat buffer
    (:mod:`hvd_trainer.comm.ops.flatten`). Every rank must pass tensors of the same shapes and
    dtypes in the same order.

    Raises:
        CommTypeError: a dtype that cannot travel (e.g. int16; see ``SUPPORTED_DTYPES``).
    """
    flat_collective_(tensors, lambda flat: broadcast_(flat, root_rank, world=world),
                     what="broadcast_parameters")


def _as_named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda kv: kv[0])
    elif isinstance(params, Iterable):
        items = list(params)
        if items and all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in items):
            items.sort(key=lambda kv: kv[0])  # matched by name, as Horovod does: order-free
    else:
        raise TypeError(
            f"params must be a state_dict, a list of (name, tensor) or a list of tensors, got "
            f"{type(params).__name__}. HINT: broadcast_parameters(model.state_dict(), 0)."
        )
    out: list[tuple[str, torch.Tensor]] = []
    for i, item in enumerate(items):
        name, tensor = (str(item[0]), item[1]) if isinstance(item, tuple) else (f"#{i}", item)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"broadcast_parameters got a {type(tensor).__name__} entry ({item!r:.60}); "
                "expected tensors. HINT: pass model.state_dict() or model.named_parameters()."
            )
        out.append((name, tensor))
    return out


def broadcast_parameters(params: Any, root_rank: int = 0, *, world: World | None = None) -> None:
    """Copy ``root_rank``'s values into every rank's tensors, in place.

    Args:
        params: ``model.state_dict()`` or a list of ``(name, tensor)`` pairs (both matched
            by name: sent in sorted name order, as Horovod matches them by name), or a list of
            tensors (sent in list order). The same tensors on every rank.
        root_rank: the global rank whose values win.

    Raises:
        TypeError: ``params`` holds something other than tensors.
        ValueError: ``root_rank`` is not a rank; on every rank, when the ranks' tensors differ
            in name, shape, dtype or count (the message names the first one that differs).
    """
    w = get_world() if world is None else world
    _check_root(root_rank, w)
    if w.size == 1:
        _as_named_tensors(params)  # the argument errors
        return
    layout: Layout | Exception
    try:
        named = _as_named_tensors(params)
        layout = _layout(named)
    except TypeError as exc:  # this rank still takes its turn; the agreement re-raises it
        layout = exc
    _agree_on_layout(layout, root_rank, "broadcast_parameters", world=w)
    broadcast_tensors_([t for _, t in named], root_rank, world=w)


def _spec(value: Any) -> tuple[str, Any]:
    if isinstance(value, torch.Tensor):
        return ("tensor", (tuple(value.shape), value.dtype, value.device.type != "cpu"))
    return ("object", value)


def _zero_missing_grads(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's visible side effect on an optimizer without state: every trainable parameter
    without a ``.grad`` gets a zero one (frozen ones keep ``None``). No step is taken."""
    if getattr(optimizer, "zero_sharding", None) is not None:  # ZeRO: this rank's shard
        if any(optimizer.state.values()):
            return
    elif optimizer.state_dict()["state"]:
        return
    inner = getattr(optimizer, "optimizer", optimizer)
    sparse = isinstance(inner, torch.optim.SparseAdam)  # it only takes sparse gradients
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p).to_sparse() if sparse else torch.zeros_like(p)


def _optimizer_layout(optimizer: torch.optim.Optimizer) -> Layout:
    names = getattr(optimizer, "_names", None)  # DistributedOptimizer knows the parameter names
    names = names if isinstance(names, dict) else {}
    return [
        (names.get(id(p), f"param_groups[{g}][{i}]"), tuple(p.shape), str(p.dtype))
        for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])
    ]


def _state_buffers(
    meta: dict[str, Any], root_state: dict[Any, dict[str, Any]] | None, device: torch.device
) -> tuple[dict[Any, dict[str, Any]], list[torch.Tensor]]:
    """The state dict to load and its tensors in broadcast order: the root's own tensors
    (``root_state``) or, elsewhere, empty ones of the specs in ``meta``."""
    state: dict[Any, dict[str, Any]] = {}
    tensors: list[torch.Tensor] = []
    for idx in sorted(meta["state"], key=str):
        entry = state.setdefault(idx, {})
        for key in sorted(meta["state"][idx]):
            kind, spec = meta["state"][idx][key]
            if kind == "object":
                entry[key] = spec
                continue
            if root_state is not None:
                entry[key] = root_state[idx][key]
            else:
                shape, dtype, on_device = spec
                entry[key] = torch.empty(shape, dtype=dtype,
                                         device=device if on_device else torch.device("cpu"))
            tensors.append(entry[key])
    return state, tensors


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int = 0, model: Any = None, *,
    world: World | None = None,
) -> None:
    """Give every rank ``root_rank``'s optimizer hyperparameters and state buffers.

    Works for any ``torch.optim`` optimizer (and :class:`~hvd_trainer.DistributedOptimizer`,
    with ZeRO too: the root's full state is gathered from the shards, sent, and every rank keeps
    its own shard; so with ZeRO load a checkpoint on every rank, not on the root only), stateless
    ones included, and for parameters that are frozen or have no state yet. The
    root's state is sent and the others load the root's ``state_dict``: a rank without state
    receives the root's buffers, and when the root has no state yet (a fresh optimizer) every
    rank ends with none, so training starts exactly as a single process's would. Unlike Horovod
    no zero-gradient step is taken (it would give Adam a ``step`` of 1 and SGD with weight decay
    a momentum buffer, horovod/horovod#2805); as in Horovod, an optimizer without state leaves
    trainable parameters with a zero ``.grad`` instead of ``None``. ``model`` is Horovod's
    argument for sparse embeddings; it is accepted and not needed here (sparse state travels
    like any other tensor).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: ``root_rank`` is not a rank; on every rank, when the ranks' optimizers hold
            parameters of different shapes, dtypes or numbers (named in the message).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"broadcast_optimizer_state expects a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}."
        )
    w = get_world() if world is None else world
    _check_root(root_rank, w)
    del model  # accepted for Horovod's signature
    if w.size > 1:
        _agree_on_layout(_optimizer_layout(optimizer), root_rank, "broadcast_optimizer_state", world=w,
                        compare_names=False)
    _zero_missing_grads(optimizer)
    is_root = w.rank == root_rank
    # ZeRO (DistributedOptimizer(zero_stage=1|2)): the root's full state is its shard and the
    # others' gathered first; each rank's load_state_dict then keeps its own shard of it.
    sharding = getattr(optimizer, "zero_sharding", None)
    if sharding is not None and w.size > 1:
        optimizer.consolidate_state_dict(to=root_rank)
    meta = None
    if is_root:
        sd = optimizer.state_dict()
        meta = {
            "param_groups": sd["param_groups"],
            "state": {
                idx: {k: _spec(v) for k, v in entry.items()} for idx, entry in sd["state"].items()
            },
        }
    meta = broadcast_object(meta, root_rank, world=w)
    state, tensors = _state_buffers(meta, sd["state"] if is_root else None, w.device)
    broadcast_tensors_(tensors, root_rank, world=w)
    if not is_root:
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    elif sharding is not None and w.size > 1:
        sharding.pop_state_dict()  # the gathered copy is not kept on the root

"""Make model parameters and optimizer state equal on every rank (Horovod's
``broadcast_parameters`` / ``broadcast_optimizer_state``).

Tensors travel as in-place broadcasts packed into one flat buffer per (device, dtype), so a
model costs a handful of collectives, not one per tensor. Everything that is not a tensor
(hyperparameters such as ``lr``, ``betas``, ``momentum``; non-tensor state) is pickled from the
root, so its Python type is kept (tuples stay tuples, ints stay ints).

No optimizer step is run: a rank whose optimizer has no state yet gets empty tensors shaped
like the root's and receives their values, so the next step computes exactly what the root's
optimizer would compute.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hvd_trainer.comm import World, broadcast_, broadcast_object, get_world
from hvd_trainer.comm.flatten import flat_collective_

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_tensors_"]


def _check_root(root_rank: int, world: World) -> None:
    if not isinstance(root_rank, int) or not 0 <= root_rank < world.size:
        raise ValueError(
            f"root_rank={root_rank!r} is not a rank of a world of size {world.size}. "
            "HINT: use root_rank=0."
        )


def broadcast_tensors_(tensors: list[torch.Tensor], root_rank: int, *, world: World) -> None:
    """Overwrite every tensor with ``root_rank``'s values, in place.

    Tensors are grouped by (device, dtype) and each group is sent as one flat buffer
    (:mod:`hvd_trainer.comm.flatten`). Every rank must pass tensors of the same shapes and
    dtypes in the same order.

    Raises:
        CommTypeError: a dtype that cannot travel (e.g. int16; see ``SUPPORTED_DTYPES``).
    """
    flat_collective_(tensors, lambda flat: broadcast_(flat, root_rank, world=world),
                     what="broadcast_parameters")


def _as_tensor_list(params: Any) -> list[torch.Tensor]:
    if isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda kv: kv[0])
    elif isinstance(params, Iterable):
        items = list(params)
    else:
        raise TypeError(
            f"params must be a state_dict, a list of (name, tensor) or a list of tensors, got "
            f"{type(params).__name__}. HINT: broadcast_parameters(model.state_dict(), 0)."
        )
    out: list[torch.Tensor] = []
    for item in items:
        tensor = item[1] if isinstance(item, tuple) else item
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"broadcast_parameters got a {type(tensor).__name__} entry ({item!r:.60}); "
                "expected tensors. HINT: pass model.state_dict() or model.named_parameters()."
            )
        out.append(tensor)
    return out


def broadcast_parameters(params: Any, root_rank: int = 0, *, world: World | None = None) -> None:
    """Copy ``root_rank``'s values into every rank's tensors, in place.

    Args:
        params: ``model.state_dict()`` (sent in sorted key order), or a list of
            ``(name, tensor)`` pairs or tensors (sent in list order). Same on every rank.
        root_rank: the global rank whose values win.

    Raises:
        TypeError: ``params`` holds something other than tensors.
        ValueError: ``root_rank`` is not a rank.
    """
    w = get_world() if world is None else world
    _check_root(root_rank, w)
    broadcast_tensors_(_as_tensor_list(params), root_rank, world=w)


def _spec(value: Any) -> tuple[str, Any]:
    if isinstance(value, torch.Tensor):
        return ("tensor", (tuple(value.shape), value.dtype, value.device.type != "cpu"))
    return ("object", value)


def _initialise_empty_state(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's first step: an optimizer without state takes one step on zero gradients, so
    its state (e.g. Adam's ``exp_avg``, ``step``) exists before it is broadcast. The step runs
    on the wrapped optimizer (a DistributedOptimizer would allreduce). As in Horovod, every
    trainable parameter keeps the zero ``.grad`` (frozen ones keep ``None``); unlike Horovod,
    the parameter values are put back, so e.g. weight decay does not move them."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if optimizer.state_dict()["state"] or isinstance(inner, torch.optim.LBFGS):  # LBFGS: closure
        return
    params = [p for g in inner.param_groups for p in g["params"] if p.requires_grad]
    saved = [(p, p.detach().clone()) for p in params]
    with torch.no_grad():
        for p in params:
            p.grad = torch.zeros_like(p)
        try:
            inner.step()
        finally:
            for p, value in saved:
                p.copy_(value)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int = 0, model: Any = None, *,
    world: World | None = None,
) -> None:
    """Give every rank ``root_rank``'s optimizer hyperparameters and state buffers.

    Works for any ``torch.optim`` optimizer (and :class:`~hvd_trainer.DistributedOptimizer`),
    stateless ones included, and for parameters that are frozen or have no state yet. As in
    Horovod, an optimizer whose state is empty first takes one step on zero gradients (the
    trainable parameters keep those zero ``.grad``, as in Horovod; their values are restored),
    so e.g. Adam's ``step`` and moments exist on every rank after the broadcast. The root's
    state is then sent; the others load the root's ``state_dict``. ``model`` is Horovod's
    argument for sparse embeddings; it is accepted and not needed here (sparse state travels
    like any other tensor).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: ``root_rank`` is not a rank; the ranks' optimizers have different
            parameter groups (from ``load_state_dict``).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"broadcast_optimizer_state expects a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}."
        )
    w = get_world() if world is None else world
    _check_root(root_rank, w)
    del model  # accepted for Horovod's signature
    _initialise_empty_state(optimizer)
    is_root = w.rank == root_rank
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
    state: dict[Any, dict[str, Any]] = {}
    tensors: list[torch.Tensor] = []
    for idx in sorted(meta["state"], key=str):
        entry = state.setdefault(idx, {})
        for key in sorted(meta["state"][idx]):
            kind, spec = meta["state"][idx][key]
            if kind == "object":
                entry[key] = spec
                continue
            if is_root:
                entry[key] = sd["state"][idx][key]
            else:
                shape, dtype, on_device = spec
                device = w.device if on_device else torch.device("cpu")
                entry[key] = torch.empty(shape, dtype=dtype, device=device)
            tensors.append(entry[key])
    broadcast_tensors_(tensors, root_rank, world=w)
    if not is_root:
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})

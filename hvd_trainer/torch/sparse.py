"""Allgather-based reduction of sparse COO gradients (``nn.Embedding(sparse=True)``).

A sparse gradient touches few rows of a large table, so sending the dense table would waste
bandwidth. Instead every rank's indices and values are concatenated on every rank (two
allgathers, Horovod's ``sparse_allreduce_async``), then duplicates are summed by
``coalesce()`` and, for ``Average``, the values are divided by the world size. Every rank
coalesces the same gathered tensors in the same order, so the results are bit-identical.
"""

from __future__ import annotations

import torch

from hvd_trainer.comm import (
    CommTypeError,
    CommValueError,
    Handle,
    ProcessSet,
    ReduceOp,
    World,
    allgather,
    allgather_async,
    reject_adasum,
    resolve_set,
    to_reduce_op,
)

__all__ = ["sparse_allreduce", "sparse_allreduce_async"]


def sparse_allreduce(
    grad: torch.Tensor | None,
    *,
    like: torch.Tensor,
    sparse_dim: int,
    op: ReduceOp | str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    world: World,
) -> torch.Tensor:
    """Sum (or average) one sparse COO gradient over all ranks.

    Args:
        grad: this rank's sparse COO gradient, or ``None`` when the parameter got no gradient
            here (it contributes nothing, but the rank still takes part so nobody hangs).
        like: the parameter; gives shape, dtype and device of the result.
        sparse_dim: number of sparse dimensions (1 for ``nn.Embedding``); equal on all ranks.
        op: ``Average`` (default) or ``Sum``.
        prescale_factor / postscale_factor: multiply the values before / after the sum.

    Returns:
        A coalesced sparse COO tensor shaped like ``like``.
    """
    rop = reject_adasum(to_reduce_op(op), "sparse allreduce")
    if grad is None:
        indices = torch.zeros((0, sparse_dim), dtype=torch.int64, device=like.device)
        values = like.new_zeros((0, *like.shape[sparse_dim:]))
    else:
        grad = grad.coalesce()
        indices = grad.indices().t().contiguous()  # [nnz, sparse_dim]: allgather on dim 0
        values = grad.values().contiguous()
    if prescale_factor != 1.0:
        values = values * prescale_factor
    all_indices = allgather(indices, world=world)
    all_values = allgather(values, world=world)
    out = torch.sparse_coo_tensor(
        all_indices.t(), all_values, like.shape, check_invariants=False
    ).coalesce()
    scale = postscale_factor / world.size if rop is ReduceOp.AVERAGE else postscale_factor
    if scale != 1.0:
        out = torch.sparse_coo_tensor(
            out.indices(), out.values() * scale, like.shape, check_invariants=False
        ).coalesce()
    return out


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp | str | None = None,
    process_set: ProcessSet | None = None,
    *,
    world: World | None = None,
) -> Handle:
    """Start summing (or averaging) a sparse COO tensor over the set (Horovod's
    ``sparse_allreduce_async``): two async allgathers, of the indices and of the values.

    Args:
        tensor: sparse COO tensor of the same dense shape, dtype and ``sparse_dim`` on every
            member; its ``nnz`` may differ.
        name: label for errors and the timeline (``<name>.indices`` / ``<name>.values``); a
            named call is matched across ranks by name (:mod:`hvd_trainer.comm.ops.by_name`).
        op: ``Average`` (default: values divided by the set size) or ``Sum``.
        process_set: the ranks to reduce over (``None``: the whole job).

    Returns:
        A :class:`Handle`; ``synchronize(handle)`` (or ``handle()``, Horovod's idiom) returns the
        coalesced sparse COO result with ``tensor``'s shape, identical on every member.

    Raises:
        CommTypeError: ``tensor`` is not a sparse COO tensor. CommValueError: ``op`` is not
        Average or Sum.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.sparse_coo:
        raise CommTypeError(
            f"sparse_allreduce_async expects a sparse COO tensor, got "
            f"{getattr(tensor, 'layout', type(tensor).__name__)}. HINT: use allreduce_async for dense "
            "tensors, or tensor.to_sparse()."
        )
    rop = reject_adasum(to_reduce_op(op), "sparse allreduce")
    if rop not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise CommValueError(f"sparse_allreduce_async(op={rop}) supports Average or Sum only.")
    pset = resolve_set(process_set, world, "sparse_allreduce_async")
    t = tensor.detach().coalesce()
    indices = allgather_async(t.indices().t().contiguous(), f"{name}.indices" if name else None,
                              process_set, world=world)
    values = allgather_async(t.values().contiguous(), f"{name}.values" if name else None,
                             process_set, world=world)

    def finish() -> torch.Tensor:
        out = torch.sparse_coo_tensor(indices.wait().t(), values.wait(), t.shape,
                                      check_invariants=False).coalesce()
        if rop is ReduceOp.AVERAGE:
            out = torch.sparse_coo_tensor(out.indices(), out.values() / pset.size(), t.shape,
                                          check_invariants=False).coalesce()
        return out

    return Handle([indices, values], finish)

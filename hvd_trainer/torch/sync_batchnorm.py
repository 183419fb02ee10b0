"""Batch normalization over the global batch, on CPU (gloo) and CUDA (NCCL).

``torch.nn.SyncBatchNorm`` refuses CPU input; this subclass replaces its forward.

Forward (training, world size > 1), per channel ``c`` and rank ``r`` with ``n_r`` elements:
each rank computes its count, mean and M2 (sum of squared deviations from its own mean) and
one allgather shares them. They are combined with the pairwise formula of Chan, Golub and
LeVeque (1979, "Updating formulae and a pairwise algorithm for computing sample variances"):
``mean = sum_r n_r mean_r / N`` and ``M2 = sum_r (M2_r + n_r (mean_r - mean)^2)``, which
avoids the cancellation of ``E[x^2] - E[x]^2``. Normalization uses the biased variance
``M2 / N``; the running variance is updated with the unbiased ``M2 / (N - 1)``, as
``nn.BatchNorm`` does over one batch of ``N``.

Backward, with ``xhat = (x - mean) * invstd`` and ``g = dL/dy * weight``:
``dx = invstd * (g - sum(g)/N - xhat * sum(g * xhat)/N)``, where the two channel sums run
over the global batch (one allreduce of ``2C`` numbers). ``dweight`` and ``dbias`` are this
rank's sums; the gradient reducer then averages them like any other parameter gradient.

Both collectives are the comm layer's named, cross-rank-checked ones (``"SyncBatchNorm.forward"``
allgather, ``"SyncBatchNorm.backward"`` allreduce): a rank that skips a forward, or runs another
collective in its place, raises :class:`~hvd_trainer.comm.base.errors.CollectiveMismatchError` on every
rank instead of hanging. A raw ``torch.distributed`` ``process_group`` (torch's own API) is still
honoured, over plain ``torch.distributed`` calls without those checks; pass a comm
:class:`~hvd_trainer.comm.ProcessSet` instead to keep them.

The Lightning ``LayerSync`` plugin for this layer is
:class:`hvd_trainer.lightning.plugins.HorovodSyncBatchNorm` (the torch API imports no Lightning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hvd_trainer.comm import (
    BatchNormBase,
    ProcessSet,
    Sum,
    World,
    allgather,
    allreduce_,
    get_world,
    is_initialized,
)

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]

FORWARD_NAME = "SyncBatchNorm.forward"
"""Name of the statistics allgather (cross-rank checks, timeline)."""
BACKWARD_NAME = "SyncBatchNorm.backward"
"""Name of the gradient-sums allreduce."""


@dataclass(frozen=True, slots=True)
class _Peers:
    """Where the layer's two collectives run: a comm world / process set (checked), or a raw
    ``torch.distributed`` group given as ``process_group`` (unchecked, torch's API)."""

    size: int
    world: World | None = None
    process_set: ProcessSet | None = None
    group: Any = None

    def gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """``[k]`` on every rank -> ``[size, k]`` in rank order."""
        if self.group is not None:
            rows = [torch.empty_like(row) for _ in range(self.size)]
            dist.all_gather(rows, row, group=self.group)
            return torch.stack(rows)
        return allgather(row.unsqueeze(0), name=FORWARD_NAME, process_set=self.process_set, world=self.world)

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place."""
        if self.group is not None:
            dist.all_reduce(tensor, group=self.group)
            return tensor
        return allreduce_(tensor, op=Sum, name=BACKWARD_NAME, process_set=self.process_set, world=self.world)


class _WorldRef:
    """Holds a layer's world. Copies of the layer share it (a ``World`` holds process groups,
    which cannot be copied or pickled); a pickled layer drops it and resolves it again."""

    __slots__ = ("world",)

    def __init__(self, world: World | None) -> None:
        self.world = world

    def __deepcopy__(self, memo: dict[int, Any]) -> _WorldRef:
        return self

    def __reduce__(self) -> tuple[type, tuple[None]]:
        return _WorldRef, (None,)


def _channel_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _check_input(x: torch.Tensor) -> None:
    """Reject what ``torch.nn.SyncBatchNorm`` rejects, with its messages (ValueError)."""
    if x.dim() < 2:
        raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")
    if x.size(1) == 0:
        raise ValueError("SyncBatchNorm number of input channels should be non-zero")


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _gather_stats(x: torch.Tensor, peers: _Peers) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global per-channel (mean, M2) in fp32 or wider, and the global count N."""
    dims = _channel_dims(x)
    acc = _wide(x)
    n = acc.numel() // acc.shape[1]
    if n > 0:
        mean = acc.mean(dims)
        m2 = (acc - mean.view(1, -1, *[1] * (x.dim() - 2))).square().sum(dims)
    else:
        mean = acc.new_zeros(acc.shape[1])
        m2 = acc.new_zeros(acc.shape[1])
    local = torch.cat([mean.new_tensor([float(n)]), mean, m2])
    table = peers.gather_rows(local)  # [size, 1 + 2C]
    c = acc.shape[1]
    counts, means, m2s = table[:, :1], table[:, 1 : 1 + c], table[:, 1 + c :]
    total = counts.sum()
    g_mean = (counts * means).sum(0) / total
    g_m2 = (m2s + counts * (means - g_mean).square()).sum(0)
    return g_mean, g_m2, total


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, peers):
        mean, m2, total = _gather_stats(x, peers)
        if int(total.item()) <= 1:
            raise ValueError(
                f"SyncBatchNorm needs more than 1 value per channel over all ranks, got "
                f"{int(total.item())} (input shape {tuple(x.shape)} on this rank)."
            )
        var = m2 / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                unbiased = m2 / (total - 1)
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = (1, -1, *[1] * (x.dim() - 2))
        xhat = (_wide(x) - mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.peers, ctx.total, ctx.bias_dtype = peers, total, None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, invstd, weight = ctx.saved_tensors
        dims = _channel_dims(xhat)
        shape = (1, -1, *[1] * (xhat.dim() - 2))
        dy32 = _wide(dy).to(xhat.dtype)
        x32 = xhat
        sum_dy = dy32.sum(dims)
        sum_dy_xhat = (dy32 * x32).sum(dims)
        grad_w = grad_b = grad_x = None
        if weight is not None:
            grad_w = sum_dy_xhat.to(weight.dtype)
        if ctx.bias_dtype is not None:
            grad_b = sum_dy.to(ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            sums = ctx.peers.sum_(torch.cat([sum_dy, sum_dy_xhat]))
            c = sum_dy.numel()
            g_sum_dy, g_sum_dy_xhat = sums[:c], sums[c:]
            w = weight.to(dy32.dtype) if weight is not None else torch.ones_like(g_sum_dy)
            g = dy32 - (g_sum_dy / ctx.total).view(shape)
            g = g - x32 * (g_sum_dy_xhat / ctx.total).view(shape)
            grad_x = (g * (w * invstd).view(shape)).to(dy.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """``BatchNorm{1,2,3}d`` whose training statistics span every rank's batch.

    Input ``[N, C, *]`` of any float dtype, on CPU or CUDA. In training mode the output,
    running statistics and gradients equal ``nn.BatchNorm`` applied to the concatenation of
    all ranks' batches. Eval mode uses the (identical) running statistics without
    communication; a world of one (or no ``hvd_trainer.init()``) falls back to
    ``F.batch_norm``. Every rank must run forward and backward of the layer together.

    Args: as ``torch.nn.SyncBatchNorm``, plus ``world``. ``process_group``: ``None`` (the whole
        world), a comm :class:`~hvd_trainer.comm.ProcessSet`, or a raw ``torch.distributed``
        group (then without cross-rank checks). ``world``: the world to normalise over; default
        the initialised one, looked up at the first training forward and kept (copies of the
        layer share it).

    Raises:
        ValueError: input with fewer than 2 dims, or a single value per channel overall.
        CollectiveMismatchError: ranks ran the layer's collectives out of step (one skipped a
            forward, or ran another collective instead), raised on every rank.
    """

    def __init__(self, *args: Any, world: World | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._world_ref = _WorldRef(world)

    @property
    def world(self) -> World | None:
        """The world this layer normalises over (``None`` until resolved, or before ``init()``)."""
        return self._world_ref.world

    def _peers(self) -> _Peers:
        group = self.process_group
        if group is not None and not isinstance(group, ProcessSet):
            return _Peers(size=dist.get_world_size(group), group=group)
        if self._world_ref.world is None:
            if not is_initialized():
                return _Peers(size=1)
            self._world_ref.world = get_world()
        world = self._world_ref.world
        size = world.size if group is None else group.size()
        return _Peers(size=size, world=world, process_set=group)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        _check_input(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as nn.BatchNorm
                factor = 1.0 / float(self.num_batches_tracked.item())
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        peers = self._peers() if self.training else _Peers(size=1)
        if not (bn_training and self.training) or peers.size == 1:
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, bn_training, factor,
                self.eps,
            )
        return _SyncBatchNormFn.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, peers,
        )

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, process_group: Any = None, *, world: World | None = None
    ):
        """Return ``module`` with every ``nn.BatchNorm*d`` (and torch ``SyncBatchNorm``)
        replaced by this class, sharing the same parameters and buffers (and ``world``)."""
        out = module
        if isinstance(module, BatchNormBase) and not isinstance(module, cls):
            out = cls(
                module.num_features, module.eps, module.momentum, module.affine,
                module.track_running_stats, process_group, bias=module.bias is not None,
                world=world,
            )
            if module.affine:
                out.weight, out.bias = module.weight, module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_group, world=world))
        return out


def convert_sync_batchnorm(module: torch.nn.Module, *, world: World | None = None) -> torch.nn.Module:
    """Replace every BatchNorm layer of ``module`` by :class:`SyncBatchNorm` (see there)."""
    return SyncBatchNorm.convert_sync_batchnorm(module, world=world)

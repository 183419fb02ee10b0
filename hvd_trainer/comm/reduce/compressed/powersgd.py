"""PowerSGD's tensor math (Vogels et al. 2019, arXiv:1905.13727), no communication.

A gradient ``G`` of shape ``[d0, d1, ...]`` is the matrix ``M = G.reshape(d0, -1)`` (``n x m``).
One step with rank ``r``, warm-start ``Q`` (``m x r``) and residual ``E``:

1. ``M = G + E``; ``P = M Q``                        (allreduce-sum of P over ranks)
2. ``P = orthogonalize(P)``                           (Gram-Schmidt on the columns)
3. ``Q = M^T P``                                      (allreduce-sum of Q over ranks)
4. ``G_hat = P Q^T``; ``E = M - G_hat / N``; keep ``Q`` for the next step.

Since the reducer multiplies ``G`` by ``1/N`` before the sum, the sums are the averages. ``G_hat``
approximates the *sum* of the ranks' ``M``, so each rank keeps ``M - G_hat / N``: the residuals
then sum to exactly what the approximation lost (torch's ``powerSGD_hook``, which does not
prescale, keeps ``M - G_hat`` of the average: the same thing in its units).
"""

from __future__ import annotations

import zlib

import torch

__all__ = ["matrix_shape", "orthogonalize_", "initial_q"]


def matrix_shape(shape: torch.Size, rank: int, min_numel: int) -> tuple[int, int] | None:
    """``(n, m)`` when a tensor of ``shape`` is compressed, else ``None`` (1-D, fewer than
    ``min_numel`` values, or a factorisation no smaller than the matrix)."""
    if len(shape) < 2:
        return None
    n = shape[0]
    m = shape.numel() // max(1, n)
    if n * m < max(1, min_numel) or (n + m) * rank >= n * m:
        return None
    return n, m


def orthogonalize_(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Orthonormalise the columns of ``p`` (``n x r``, fp32) in place, by Gram-Schmidt.

    A zero column stays zero (divided by ``norm + eps``)."""
    r = p.shape[1]
    for i in range(r):
        col = p[:, i : i + 1]
        col.div_(col.norm() + eps)
        if i + 1 < r:
            rest = p[:, i + 1 :]
            rest.sub_(col @ (col.T @ rest))
    return p


def initial_q(name: str, m: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
    """The first ``Q`` (``m x r``, fp32, standard normal) of the parameter ``name``: the same on
    every rank (seeded from ``seed`` and the name, not from the global RNG)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(m, rank, generator=gen, dtype=torch.float32).to(device)

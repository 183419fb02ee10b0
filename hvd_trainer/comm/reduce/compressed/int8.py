"""int8 block quantisation (pure tensor math, no communication).

A 1-D fp32 tensor of ``n`` values is padded with zeros to ``nb = ceil(n / B)`` blocks of ``B``
values; block ``b`` gets the fp32 scale ``s_b = max|x_b| / 127`` and the int8 values
``q = clamp(round(x / s_b), -127, 127)`` (a block of zeros: ``s_b = 0``, ``q = 0``). Dequantised:
``q * s_b``. The error per value is at most ``s_b / 2``; zeros stay exactly zero.

Wire layout of one rank's payload (uint8): ``nb * B`` int8 values, then ``nb`` fp32 scales
(``4 nb`` bytes), then ``k`` fp32 extras sent exactly (the reducer's per-parameter "used"
flags): ``nb * (B + 4) + 4 k`` bytes.
"""

from __future__ import annotations

import torch

__all__ = ["quantize", "dequantize", "pack", "unpack", "payload_bytes"]


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (1-D, any float dtype) -> ``(q int8 [nb * block], scales fp32 [nb])``."""
    n = x.numel()
    nb = -(-n // block)
    padded = torch.zeros(nb * block, dtype=torch.float32, device=x.device)
    padded[:n] = x
    blocks = padded.view(nb, block)
    scales = blocks.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(-1), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """fp32 values ``[numel]`` from :func:`quantize`'s output."""
    nb = scales.numel()
    return (q.view(nb, -1).to(torch.float32) * scales[:, None]).reshape(-1)[:numel]


def payload_bytes(numel: int, block: int, extras: int) -> int:
    """Bytes of one rank's packed payload."""
    nb = -(-numel // block)
    return nb * block + 4 * nb + 4 * extras


def pack(q: torch.Tensor, scales: torch.Tensor, extras: torch.Tensor) -> torch.Tensor:
    """One uint8 buffer: int8 values, fp32 scales, fp32 extras."""
    return torch.cat([q.view(torch.uint8), scales.contiguous().view(torch.uint8),
                      extras.to(torch.float32).contiguous().view(torch.uint8)])


def unpack(
    buf: torch.Tensor, numel: int, block: int, extras: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack`: ``(q, scales, extras)`` views into ``buf``."""
    nb = -(-numel // block)
    q = buf[: nb * block].view(torch.int8)
    scales = buf[nb * block : nb * block + 4 * nb].view(torch.float32)
    rest = buf[nb * block + 4 * nb : nb * block + 4 * nb + 4 * extras].view(torch.float32)
    return q, scales, rest

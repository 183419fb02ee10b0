"""A decoder-only transformer language model (GPT-2 layout, as in nanoGPT), in plain torch.

Pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP, learnt position embeddings, the
output projection tied to the token embedding. Attention uses
``F.scaled_dot_product_attention(is_causal=True)`` (flash / memory-efficient kernels on GPUs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTShape", "GPT"]


@dataclass(kw_only=True, slots=True)
class GPTShape:
    """Sizes of the network (the recipe's ``model`` config carries the same fields)."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float


class _SelfAttention(nn.Module):
    def __init__(self, s: GPTShape) -> None:
        super().__init__()
        self.n_head = s.n_head
        self.qkv = nn.Linear(s.n_embd, 3 * s.n_embd, bias=False)
        self.proj = nn.Linear(s.n_embd, s.n_embd, bias=False)
        self.dropout = s.dropout
        self.resid_drop = nn.Dropout(s.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # [b, t, c] -> [b, heads, t, c / heads]
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class _Block(nn.Module):
    def __init__(self, s: GPTShape) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(s.n_embd)
        self.attn = _SelfAttention(s)
        self.ln2 = nn.LayerNorm(s.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(s.n_embd, 4 * s.n_embd, bias=False), nn.GELU(),
            nn.Linear(4 * s.n_embd, s.n_embd, bias=False), nn.Dropout(s.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Next-token logits for a batch of token ids.

    Args:
        shape: the network's sizes; ``n_embd`` must be a multiple of ``n_head``.

    Raises:
        ValueError: ``n_embd % n_head != 0``.
    """

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        if shape.n_embd % shape.n_head:
            raise ValueError(
                f"model.n_embd={shape.n_embd} must be a multiple of model.n_head={shape.n_head}."
            )
        self.shape = shape
        self.tok = nn.Embedding(shape.vocab_size, shape.n_embd)
        self.pos = nn.Embedding(shape.block_size, shape.n_embd)
        self.drop = nn.Dropout(shape.dropout)
        self.blocks = nn.ModuleList(_Block(shape) for _ in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(shape.n_embd)
        self.head = nn.Linear(shape.n_embd, shape.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying (Press & Wolf 2017), as GPT-2
        self.apply(self._init)
        # GPT-2's scaled init of the residual projections: the residual stream's variance does
        # not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * shape.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameters counted once (the tied head is the embedding), position embeddings included."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), PaLM's estimate 6N + 12 L T C."""
        s = self.shape
        return 6.0 * self.num_params() + 12.0 * s.n_layer * s.block_size * s.n_embd

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx``: int64 ``[batch, time]``, time <= block_size -> float logits ``[batch, time, vocab]``."""
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, *, temperature: float = 0.8,
                 top_k: int = 40, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``new_tokens`` tokens after the prompt ``idx`` (int64 ``[batch, time]``);
        returns ``[batch, time + new_tokens]``."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.shape.block_size :])[:, -1, :] / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits.float(), dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx

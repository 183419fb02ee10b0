"""Atomic checkpoint files: a kill during a write never leaves a half-written checkpoint.

A write goes to a temporary file in the target's directory, is flushed and ``fsync``-ed, then
renamed over the target with ``os.replace`` (atomic on POSIX and Windows within one file
system), and the directory is ``fsync``-ed so the rename survives a power loss. Readers see
either the previous complete file or the new complete file.

Example::

    from hvd_trainer.checkpoint import save_checkpoint, load_checkpoint
    save_checkpoint({"model": model.state_dict(), "step": step}, "ckpt/last.pt")  # rank 0 writes
    state = load_checkpoint("ckpt/last.pt")

Lightning's atomic ``CheckpointIO`` is :class:`hvd_trainer.lightning.checkpoint_io.AtomicCheckpointIO`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from hvd_trainer.comm import get_world, is_initialized

__all__ = ["atomic_save", "save_checkpoint", "load_checkpoint", "discard"]


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (temp file + fsync + ``os.replace``).

    Every process that calls it writes; use :func:`save_checkpoint` for rank 0 only. On any
    error (including ``KeyboardInterrupt``) the temporary file is removed and ``path`` is left
    as it was. A process killed mid-write leaves ``path`` intact plus a stray
    ``.<name>.*.tmp`` file next to it.

    Returns:
        The target path.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)
    return target


def discard(path: str | os.PathLike[str]) -> None:
    """Remove ``path`` and every ``.<name>.*.tmp`` that an interrupted :func:`atomic_save` of it
    left next to it (a process killed mid-write). Call it only once nothing writes ``path``. The
    folder may vanish meanwhile (another host's rank cleaning the same shared folder): nothing is
    raised for that."""
    target = Path(path)
    target.unlink(missing_ok=True)
    with contextlib.suppress(FileNotFoundError):  # the folder removed while it was listed
        for stray in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
            stray.unlink(missing_ok=True)


def save_checkpoint(obj: Any, path: str | os.PathLike[str], *, rank: int | None = None) -> bool:
    """Write ``obj`` atomically on global rank 0 only; return whether this process wrote.

    Args:
        obj: anything ``torch.save`` accepts (tensors keep their dtype/device tags).
        path: target file; its directory is created.
        rank: this process's global rank; ``None`` reads it from the initialised
            :class:`~hvd_trainer.comm.world.world.World` (0 when there is none).
    """
    if rank is None:
        rank = get_world().rank if is_initialized() else 0
    if rank != 0:
        return False
    atomic_save(obj, path)
    return True


def load_checkpoint(
    path: str | os.PathLike[str], *, map_location: Any = "cpu", weights_only: bool = False
) -> Any:
    """``torch.load`` of a checkpoint written by :func:`atomic_save` (CPU by default)."""
    return torch.load(path, map_location=map_location, weights_only=weights_only)

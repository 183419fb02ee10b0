"""Lightning ``CheckpointIO`` with atomic local writes.

Example::

    from hvd_trainer.lightning.checkpoint_io import AtomicCheckpointIO
    trainer = Trainer(strategy="horovod", plugins=[AtomicCheckpointIO()])
"""

from __future__ import annotations

import os
from typing import Any

from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from hvd_trainer.checkpoint import atomic_save

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` whose local writes are atomic (see :func:`atomic_save`).

    Lightning already calls ``save_checkpoint`` on global rank 0 only. Remote URLs
    (``s3://...``) fall back to Lightning's own fsspec writer.

    Raises:
        TypeError: ``storage_options`` were passed (not supported by torch.save either).
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"AtomicCheckpointIO.save_checkpoint got storage_options={storage_options!r}; "
                "it takes none. HINT: subclass it to use custom storage options."
            )
        if "://" in str(path):
            super().save_checkpoint(checkpoint, path)
            return
        atomic_save(checkpoint, path)

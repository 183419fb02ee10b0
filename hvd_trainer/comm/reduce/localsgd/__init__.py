"""Local steps (DiLoCo / LocalSGD): ranks train alone for ``H`` steps, then an outer optimizer
applies the averaged parameter change. See :mod:`hvd_trainer.comm.reduce.localsgd.outer`."""

from __future__ import annotations

from hvd_trainer.comm.reduce.localsgd.outer import (
    DEFAULT_SYNC_WARMUP_STEPS,
    LocalSGDConfig,
    LocalSGDConfigError,
    OuterArgs,
    OuterSync,
    refuse_fragments_with_auto,
)

__all__ = ["DEFAULT_SYNC_WARMUP_STEPS", "LocalSGDConfig", "LocalSGDConfigError", "OuterArgs", "OuterSync",
           "refuse_fragments_with_auto"]

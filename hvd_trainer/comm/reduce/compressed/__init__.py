"""Lossy gradient compression with error feedback: ``int8`` blocks and PowerSGD (the
algorithms and their per-parameter state; the specs are in :mod:`hvd_trainer.comm.ops.compression`)."""

from __future__ import annotations

from hvd_trainer.comm.reduce.compressed.reductions import (
    BucketView,
    FeedbackState,
    merge_feedback,
    reduce_with_feedback,
    rename_feedback,
    start_bucket_reduction,
)

__all__ = ["BucketView", "FeedbackState", "merge_feedback", "reduce_with_feedback", "rename_feedback",
           "start_bucket_reduction"]

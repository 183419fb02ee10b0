"""Lightning-only parts of hvd_trainer, beside ``hvd_trainer/strategy.py``: the cluster
environment, elastic fit, callbacks, the SyncBatchNorm plugin and an atomic ``CheckpointIO``.

Importing any module here imports Lightning; ``import hvd_trainer`` alone does not.
"""

# Lightning first: its import fires hvd_trainer's registration hook, which imports
# hvd_trainer.strategy, which imports modules of this package. Imported here, before any of them
# has started, each of them is complete when the strategy needs it (imported first from inside
# e.g. lightning/elastic.py, the hook would meet that module half-initialised).
import pytorch_lightning  # noqa: F401

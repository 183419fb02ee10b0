"""Lightning-only parts of hvd_trainer, beside ``hvd_trainer/strategy.py``: the cluster
environment, elastic fit, callbacks and the SyncBatchNorm plugin.

Importing any module here imports Lightning; ``import hvd_trainer`` alone does not.
"""

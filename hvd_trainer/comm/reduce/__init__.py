"""comm's reduce layer: gradient reduction over fused buckets.

The hook-driven gradient reducer (``fusion``: buckets of gradients, one async allreduce per full
bucket, waited on before the optimizer step) and the search of its bucket layout
(``autotune``). Gradient-reduction algorithm families that ride on the buckets get their own
sub-packages beside these modules. Modules here may import :mod:`~hvd_trainer.comm.base`,
:mod:`~hvd_trainer.comm.world`, :mod:`~hvd_trainer.comm.ops` and this package; never
``session`` or ``runtime`` (``tests/unit/test_layering.py``).
"""

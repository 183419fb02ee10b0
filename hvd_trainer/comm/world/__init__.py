"""comm's world layer: who takes part in the job and whether they are still there.

The :class:`~hvd_trainer.comm.world.world.World` and its current-world slot (``world``), which
peers are alive (``liveness``), the partition heartbeat (``heartbeat``), the job secret checked
at init (``membership``), the store protocol behind ``join`` (``join_board``) and Horovod's
``*_built`` / ``*_enabled`` queries (``build_info``). Modules here import only :mod:`~hvd_trainer.comm.base`
and this package; never :mod:`~hvd_trainer.comm.ops`, :mod:`~hvd_trainer.comm.reduce`,
``session`` or ``runtime`` (``tests/unit/test_layering.py``).
"""

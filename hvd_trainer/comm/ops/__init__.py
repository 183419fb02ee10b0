"""comm's ops layer: the collectives, from their arguments to the blocking forms.

Reduce ops and argument checks (``ops``, ``arguments``, ``optimizer_args``), dtype flattening
(``flatten``), cross-rank signature checks and stall inspection (``checks``), the timeline,
process sets and their registry, and the collectives themselves: the one allreduce path
(``reduce``, with wire ``compression`` and ``adasum``), handles, the async forms
(``reductions_async``, ``movement_async``), the differentiable forms (``autograd``), the
blocking forms (``collectives``) and object collectives (``objects``). Modules here import
:mod:`~hvd_trainer.comm.base`, :mod:`~hvd_trainer.comm.world` and this package; never
:mod:`~hvd_trainer.comm.reduce`, ``session`` or ``runtime`` (``tests/unit/test_layering.py``).
"""

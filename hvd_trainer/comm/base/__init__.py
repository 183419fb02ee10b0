"""comm's base layer: what every other part of comm stands on, with no comm import of its own
but ``_torch_compat`` (for ``store``).

The job's key-value store (``store``), the typed ``CommConfig`` and its environment variables
(``config``), the one reader of launcher variables (``launch_env``), the error classes
(``errors``), hard exits after a stall or a lost peer (``fatal``) and every torch internal comm
relies on (``_torch_compat``). Modules here import nothing from the other comm sub-packages
(``world``, ``ops``, ``reduce``) nor ``session`` / ``runtime`` (``tests/unit/test_layering.py``).
"""

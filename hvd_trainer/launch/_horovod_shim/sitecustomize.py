"""Put on the workers' ``PYTHONPATH`` by ``hvdrun --as-horovod``: ``import horovod`` resolves to
hvd_trainer (see :mod:`hvd_trainer.horovod_alias`) in every Python process of the job.

Standard library only, and nothing is imported until a program imports ``horovod``: a small
finder waits for that name, last in ``sys.meta_path`` (so an installed Horovod is found first),
or first with ``HVDRUN_AS_HOROVOD=force`` (``--as-horovod=force``). When it fires it installs
the real alias and lets it answer. This file then runs the ``sitecustomize`` it hides (the next
one on ``sys.path``, e.g. a distribution's), so that one still runs.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_FORCE = os.environ.get("HVDRUN_AS_HOROVOD") == "force"


class _HorovodBootstrap:
    """Installs :mod:`hvd_trainer.horovod_alias` the first time ``horovod`` is imported."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201 (finder protocol)
        if fullname != "horovod":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        alias = importlib.import_module("hvd_trainer.horovod_alias")
        alias.install(force=_FORCE)
        return alias.HorovodAliasFinder(force=_FORCE).find_spec(fullname, path, target)


def _run_hidden_sitecustomize() -> None:
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if _FORCE:
    sys.meta_path.insert(0, _HorovodBootstrap())
else:
    sys.meta_path.append(_HorovodBootstrap())
_run_hidden_sitecustomize()

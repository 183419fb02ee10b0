"""Put first on the ``PYTHONPATH`` of every worker hvdrun starts: what an unmodified program needs.

1. ``Trainer(strategy="horovod")`` (and a bare ``Trainer()``, see
   :mod:`hvd_trainer.lightning.porting`) without ``import hvd_trainer``: the first import of
   ``pytorch_lightning`` or ``lightning.pytorch`` imports :mod:`hvd_trainer._register`, which
   registers the strategy the moment that Lightning package is complete. Lightning 1.x had
   ``"horovod"`` built in; its programs (``LightningCLI`` ones included) import nothing else.
2. With ``HVDRUN_AS_HOROVOD`` set (``hvdrun --as-horovod``): ``import horovod`` resolves to
   hvd_trainer (see :mod:`hvd_trainer.horovod_alias`). The finder waits last in
   ``sys.meta_path`` (so an installed Horovod is found first), or first with
   ``HVDRUN_AS_HOROVOD=force`` (``--as-horovod=force``).

Standard library only, and nothing is imported until a program imports one of those names. A
Python without hvd_trainer (another interpreter started by the command) gets one warning and its
import proceeds untouched. This file then runs the ``sitecustomize`` it hides (the next one on
``sys.path``, e.g. a distribution's), so that one still runs.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
_AS_HOROVOD = os.environ.get("HVDRUN_AS_HOROVOD")
_FORCE = _AS_HOROVOD == "force"
_LIGHTNING = ("pytorch_lightning", "lightning.pytorch")


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


class _LightningBootstrap:
    """Hands the first Lightning import to :mod:`hvd_trainer._register` (which registers
    ``"horovod"`` when that package is complete, and the other package when it is imported)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201 (finder protocol)
        if fullname not in _LIGHTNING:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            register = importlib.import_module("hvd_trainer._register")
        except ImportError as exc:
            warnings.warn(
                f"hvdrun could not register Trainer(strategy='horovod') in this Python ({sys.executable}): "
                f"{exc}. HINT: run the program with the Python that has hvd_trainer installed.",
                stacklevel=2,
            )
            return None
        register.register()
        if fullname in sys.modules:  # importing hvd_trainer imported it (and registered it)
            return None
        for finder in sys.meta_path:
            if isinstance(finder, register.RegisterOnImport):
                return finder.find_spec(fullname, path, target)
        return None


def _run_hidden_sitecustomize() -> None:
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if not any(name in sys.modules for name in _LIGHTNING):
    sys.meta_path.insert(0, _LightningBootstrap())
if _FORCE:
    sys.meta_path.insert(0, _HorovodBootstrap())
elif _AS_HOROVOD:
    sys.meta_path.append(_HorovodBootstrap())
_run_hidden_sitecustomize()

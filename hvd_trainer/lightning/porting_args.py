"""``Trainer`` arguments that Lightning 2.0 removed, met with their 2.x spelling.

On Lightning 2.x, ``Trainer(gpus=2)`` (the 1.x spelling of Horovod's examples) fails in Python's
call of ``Trainer.__init__`` with ``TypeError: ... unexpected keyword argument 'gpus'``, which
says nothing of what to write instead. :func:`install` wraps ``Trainer.__init__`` of a Lightning
package so that the arguments of :data:`REMOVED_TRAINER_ARGS` raise the porting error instead,
with the 2.x call::

    Trainer(gpus=2) is Lightning 1.x's spelling, removed in Lightning 2.0. HINT: Trainer(
    accelerator='gpu', devices=2, strategy='horovod') ...

Only removed arguments with a clear 2.x spelling are listed (Lightning's CHANGELOG for 2.0 and
the 1.7-1.9 removals); any other unknown argument stays Python's ``TypeError``, and an argument
that the installed ``Trainer`` accepts again is never intercepted. :func:`install` is idempotent
and is called for each installed Lightning package (``pytorch_lightning``, ``lightning.pytorch``)
by :func:`hvd_trainer.lightning.porting.install`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["REMOVED_TRAINER_ARGS", "Rewrite", "porting_message", "install", "install_from_connector"]

_WRAPPED = "_hvd_trainer_removed_args"


@dataclass(frozen=True, slots=True)
class Rewrite:
    """The 2.x spelling of one removed argument.

    Attributes:
        args: 2.x ``Trainer`` keywords and the source text of their values (``"'gpu'"``).
        steps: what moves out of the ``Trainer`` call (code, or a short phrase).
        callbacks: source text of callbacks for ``Trainer(callbacks=[...])``.
        device: whether it chose the device (then ``strategy='horovod'`` is proposed too).
    """

    args: Mapping[str, str]
    steps: tuple[str, ...] = ()
    callbacks: tuple[str, ...] = ()
    device: bool = False


Kwargs = Mapping[str, Any]
RewriteFn = Callable[[Any, Kwargs, str], Rewrite]
"""``(value, all the call's kwargs, package) -> Rewrite``; the package (``pytorch_lightning`` or
``lightning.pytorch``) is named in imports."""


def _gpus(value: Any, kwargs: Kwargs, pkg: str) -> Rewrite:
    if value in (None, 0, "0", []):
        return Rewrite({"accelerator": "'cpu'"}, device=True)
    return Rewrite({"accelerator": "'gpu'", "devices": repr(value)}, device=True)


def _on(accelerator: str) -> RewriteFn:
    return lambda value, kwargs, pkg: Rewrite({"accelerator": repr(accelerator), "devices": repr(value)},
                                              device=accelerator == "cpu")


def _renamed(new: str, convert: Callable[[Any], Any] = lambda v: v) -> RewriteFn:
    return lambda value, kwargs, pkg: Rewrite({new: repr(convert(value))})


def _moved(step: str) -> RewriteFn:
    """An argument whose 2.x form is outside the Trainer call; ``step`` may name {value}, {pkg}."""
    return lambda value, kwargs, pkg: Rewrite({}, (step.format(value=repr(value), pkg=pkg),))


def _auto_select_gpus(value: Any, kwargs: Kwargs, pkg: str) -> Rewrite:
    if not value:
        return Rewrite({}, ("auto_select_gpus=False was the default",))
    count = kwargs.get("gpus", "N")
    return Rewrite({"accelerator": "'cuda'", "devices": f"find_usable_cuda_devices({count!s})"},
                   (f"from {pkg}.accelerators import find_usable_cuda_devices",), device=True)


def _progress_bar_refresh_rate(value: Any, kwargs: Kwargs, pkg: str) -> Rewrite:
    if not value:
        return Rewrite({"enable_progress_bar": "False"})
    return Rewrite({}, (f"from {pkg}.callbacks import TQDMProgressBar",),
                   callbacks=(f"TQDMProgressBar(refresh_rate={value!r})",))


def _weights_summary(value: Any, kwargs: Kwargs, pkg: str) -> Rewrite:
    if value is None:
        return Rewrite({"enable_model_summary": "False"})
    depth = -1 if value == "full" else 1
    return Rewrite({}, (f"from {pkg}.callbacks import ModelSummary",),
                   callbacks=(f"ModelSummary(max_depth={depth})",))


def _tuner(name: str, method: str) -> RewriteFn:
    def rewrite(value: Any, kwargs: Kwargs, pkg: str) -> Rewrite:
        if not value:
            return Rewrite({}, (f"{name}=False was the default",))
        mode = f", mode={value!r}" if isinstance(value, str) else ""
        return Rewrite({}, (f"Tuner(trainer).{method}(model{mode}) before fit (from {pkg}.tuner "
                            "import Tuner)",))
    return rewrite


_AMP = "precision='16-mixed' is torch's AMP, Lightning 2.x's only one (apex is gone)"

REMOVED_TRAINER_ARGS: dict[str, RewriteFn] = {
    "gpus": _gpus,
    "tpu_cores": _on("tpu"),
    "num_processes": _on("cpu"),
    "auto_select_gpus": _auto_select_gpus,
    "distributed_backend": _renamed("strategy"),
    "replace_sampler_ddp": _renamed("use_distributed_sampler"),
    "checkpoint_callback": _renamed("enable_checkpointing", bool),
    "reload_dataloaders_every_epoch": _renamed("reload_dataloaders_every_n_epochs", int),
    "progress_bar_refresh_rate": _progress_bar_refresh_rate,
    "weights_summary": _weights_summary,
    "resume_from_checkpoint": _moved("trainer.fit(model, ckpt_path={value})"),
    "auto_lr_find": _tuner("auto_lr_find", "lr_find"),
    "auto_scale_batch_size": _tuner("auto_scale_batch_size", "scale_batch_size"),
    "multiple_trainloader_mode": _moved("CombinedLoader(loaders, mode={value}) as the train dataloader "
                                        "(from {pkg}.utilities import CombinedLoader)"),
    "track_grad_norm": _moved("self.log_dict(grad_norm(self, norm_type={value})) in "
                              "on_before_optimizer_step (from {pkg}.utilities import grad_norm)"),
    "amp_backend": _moved(_AMP),
    "amp_level": _moved(_AMP),
}
"""Removed argument -> its 2.x spelling. ``ipus``/``hpus`` are not listed: those accelerators left
Lightning for separate packages, with no one-line spelling."""


def porting_message(removed: Kwargs, kwargs: Kwargs, pkg: str = "pytorch_lightning",
                    environ: Mapping[str, str] | None = None) -> str:
    """The error for a ``Trainer(**kwargs)`` call that passed the ``removed`` arguments.

    ``strategy='horovod'`` is proposed with a device argument unless ``kwargs`` names another
    strategy (``accelerator='horovod'``, Lightning 1.0-1.4's Horovod, becomes that strategy).
    In a process Horovod's launcher started (``HOROVOD_RANK`` and ``HOROVOD_SIZE`` in
    ``environ``, default ``os.environ``) no ``devices=`` is proposed: each process uses one.
    """
    env = os.environ if environ is None else environ
    launched = "HOROVOD_RANK" in env and "HOROVOD_SIZE" in env
    rewrites = [REMOVED_TRAINER_ARGS[name](value, kwargs, pkg) for name, value in removed.items()]
    args: dict[str, str] = {}
    for rewrite in rewrites:
        args.update(rewrite.args)
    if launched and any(r.device for r in rewrites):
        args.pop("devices", None)
    callbacks = [c for r in rewrites for c in r.callbacks]
    if callbacks:
        args["callbacks"] = f"[{', '.join(callbacks)}]"
    if any(r.device for r in rewrites) and "strategy" not in args:
        args["strategy"] = _strategy_of(kwargs)
    old = dict(removed, **({"accelerator": "horovod"} if kwargs.get("accelerator") == "horovod" else {}))
    given = ", ".join(f"{name}={value!r}" for name, value in old.items())
    if args:
        call = f"Trainer({', '.join(f'{k}={v}' for k, v in args.items())})"
    else:
        call = f"Trainer() without {', '.join(removed)}"
    hint = "; ".join(dict.fromkeys([call, *(step for r in rewrites for step in r.steps)]))
    one_gpu_each = args.get("strategy") == "'horovod'" and args.get("accelerator") not in (None, "'cpu'")
    if one_gpu_each and launched:
        hint += " (each process hvdrun/horovodrun starts trains on one GPU, cuda:<local rank>)"
    elif one_gpu_each and "devices" in args:
        hint += (" (under hvdrun/horovodrun, leave devices= out: each process trains on one GPU, "
                 "cuda:<local rank>)")
    return f"Trainer({given}) is Lightning 1.x's spelling, removed in Lightning 2.0. HINT: {hint}."


def _strategy_of(kwargs: Kwargs) -> str:
    """Source text of the strategy to propose: the user's, else ``'horovod'``."""
    strategy = kwargs.get("strategy", "auto")
    if kwargs.get("accelerator") == "horovod" or strategy == "auto":
        return "'horovod'"
    return repr(strategy) if isinstance(strategy, str) else f"{type(strategy).__name__}(...)"


def install(trainer_cls: type, error: type[Exception]) -> None:
    """Wrap ``trainer_cls.__init__`` so that removed 1.x arguments raise ``error`` (idempotent).

    The wrapper keeps ``__init__``'s signature and docstring (``functools.wraps``: LightningCLI
    and ``inspect.signature`` see Lightning's). Arguments the installed ``Trainer`` accepts are
    left alone.

    Args:
        trainer_cls: a Lightning package's ``Trainer``.
        error: the exception class to raise (``LightningPortingError``).
    """
    init = trainer_cls.__init__
    if getattr(init, _WRAPPED, False):
        return
    accepted = set(inspect.signature(init).parameters)
    removed_names = [name for name in REMOVED_TRAINER_ARGS if name not in accepted]
    pkg = trainer_cls.__module__.partition(".trainer")[0]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 (wraps __init__)
        removed = {name: kwargs[name] for name in removed_names if name in kwargs}
        if removed:
            raise error(porting_message(removed, kwargs, pkg))
        init(self, *args, **kwargs)

    setattr(__init__, _WRAPPED, True)
    trainer_cls.__init__ = __init__


def install_from_connector(connector_cls: type, error: type[Exception]) -> None:
    """:func:`install` into the ``Trainer`` of the Lightning package whose
    ``_AcceleratorConnector`` is ``connector_cls`` (what ``porting.install`` is given)."""
    pkg = connector_cls.__module__.partition(".trainer")[0]
    install(importlib.import_module(f"{pkg}.trainer.trainer").Trainer, error)

"""SIGTERM under ``strategy="horovod"``: Lightning's graceful stop, without its raw broadcast.

Lightning 2.6's SIGTERM handler (``_SignalConnector._sigterm_notifier_fn``) calls
``torch.distributed.broadcast`` from inside the signal handler. When a launcher's agent sends
SIGTERM because another rank died (torchrun does, at once), that broadcast meets the dead peer
and gloo's ``Connection closed by peer`` escapes from wherever the main thread happened to be,
instead of the :class:`~hvd_trainer.comm.base.errors.RankFailedError` a collective would raise. And
on a healthy job it is a collective that only the signalled rank runs, out of order with the
others'.

:func:`install_sigterm_handler` replaces that handler for one ``fit``/``validate``/... with one
that keeps Lightning's meaning (``trainer.received_sigterm`` becomes True, so the loops stop
after the current step; Lightning's own per-step broadcast of rank 0's flag makes every rank
stop together; a self-launched job's launcher kills its children) and, when a peer is known to be
gone, raises ``RankFailedError`` naming it at once (exit status 75, like any rank stopped by a
peer's failure, so hvdrun blames the dead rank).
"""

from __future__ import annotations

import signal
from types import FrameType

import pytorch_lightning as pl

from hvd_trainer.comm import World, raise_if_peer_failed
from hvd_trainer.lightning._compat import replace_sigterm_notifier

__all__ = ["install_sigterm_handler"]


def install_sigterm_handler(trainer: pl.Trainer, world: World) -> None:
    """Before Lightning registers its signal handlers (``Strategy.setup`` runs first): make its
    SIGTERM notifier the one described in the module docstring."""
    store = None if world.runtime is None else world.runtime.store

    def notify(signum: int, frame: FrameType | None, *, connector: object) -> None:
        first = not connector.received_sigterm  # type: ignore[attr-defined]
        connector.received_sigterm = True  # type: ignore[attr-defined]
        launcher = trainer.strategy.launcher
        if first and launcher is not None:
            launcher.kill(signum)
        if store is not None and world.size > 1:
            name = signal.Signals(signum).name
            raise_if_peer_failed(store, range(world.size), world.rank,
                                 f"rank {world.rank}'s training, stopped by the launcher's {name},")

    replace_sigterm_notifier(trainer, notify)

"""Third-party notices that say nothing about a job hvdrun started, kept off its console.

Every ``Trainer(...)`` of Lightning 2.6 logs, on rank 0 at INFO level, a tip to install
``litlogger`` (its logger connector, ``logger_connector.py``). Under hvdrun each job would print
it once per run, in the middle of hvdrun's own lines, and it says nothing about the job. A
filter on Lightning's ``rank_zero`` logger drops that one record when the process was started by
hvdrun or horovodrun (``HOROVOD_RANK`` set) and the user did not ask for everything
(``hvdrun --verbose``, which exports ``HVD_TRAINER_VERBOSE=1``, or ``HOROVOD_LOG_LEVEL`` of
``debug``/``trace``). Every other record, including Lightning's own
``GPU available: ...`` lines, passes unchanged; a script run without hvdrun sees Lightning as it is.

Under the same condition two warnings are ignored (Python's warning filters, set when the
Lightning integration is installed): Lightning's "The `srun` command is available on your
system but is not used" (its SLURM check, whose HINT to prepend ``srun`` is wrong for a job that
hvdrun launched), and torch's ``isinstance(treespec, LeafSpec)`` deprecation, which Lightning
2.6's own pytree code triggers once per rank.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping

__all__ = ["VERBOSE_ENV", "TIP_PREFIX", "WARNINGS", "quiet_wanted", "install"]

VERBOSE_ENV = "HVD_TRAINER_VERBOSE"
"""Set to ``1`` (``hvdrun --verbose`` does) to keep every third-party line."""

TIP_PREFIX = "💡 Tip: For seamless cloud logging"
"""The start of Lightning's litlogger tip (``logger_connector.py``), matched exactly."""

# Lightning's rank_zero_info writes through these loggers (one per package spelling)
_LOGGERS = ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero",
            "lightning_fabric.utilities.rank_zero", "lightning_utilities.core.rank_zero")


def quiet_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the tip is dropped: hvdrun/horovodrun started the process (``HOROVOD_RANK``)
    and neither ``HVD_TRAINER_VERBOSE=1`` nor ``HOROVOD_LOG_LEVEL=debug|trace`` asks for it."""
    env = os.environ if environ is None else environ
    if "HOROVOD_RANK" not in env:
        return False
    if env.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes"):
        return False
    return env.get("HOROVOD_LOG_LEVEL", "").strip().lower() not in ("debug", "trace")


class _DropTip(logging.Filter):
    """Drops the litlogger tip while :func:`quiet_wanted` (read per record, so a process that
    sets the variables after import is honoured)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not quiet_wanted():
            return True
        message = record.msg if isinstance(record.msg, str) else ""
        return not message.startswith(TIP_PREFIX)


WARNINGS = (r"The `srun` command is available on your system but is not used",
            r"`isinstance\(treespec, LeafSpec\)` is deprecated")
"""Regular expressions (matched at the start of the message) of the warnings ignored under hvdrun."""


def install() -> None:
    """Add the filter to Lightning's rank-zero loggers, and the warning filters of
    :data:`WARNINGS` when :func:`quiet_wanted` (idempotent)."""
    for name in _LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropTip) for f in log.filters):
            log.addFilter(_DropTip())
    if quiet_wanted():
        for message in WARNINGS:
            warnings.filterwarnings("ignore", message=message)

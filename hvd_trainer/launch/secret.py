"""The job's secret on hvdrun's side: made or taken, handed to the workers, never shown.

Every job gets a secret, checked by every worker at init (:mod:`hvd_trainer.comm.world.membership`):

* ``HOROVOD_SECRET_KEY`` set in hvdrun's environment: that one (the same-line mode needs the
  same value on every host, as each host's hvdrun would otherwise make its own);
* otherwise one host, ``--mpi`` (mpirun carries it to every rank) or the ssh launch (each ssh
  session carries it, on stdin with the other variables): a fresh ``secrets.token_hex(16)``;
* otherwise (the same-line mode, ``--no-ssh``, without one): none, with a warning that says
  how to set it.

The workers read it from their environment (hvdrun's own, which torchrun's agent, mpirun's
``-x HOROVOD_SECRET_KEY`` and the ssh sessions pass on), so it never appears on a command line;
:func:`masked` is what ``--dry-run``/``--verbose`` print instead.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

from hvd_trainer.comm import SECRET_ENV
from hvd_trainer.launch.options import HvdrunOptions

__all__ = ["SECRET_ENV", "MASK", "job_secret", "masked"]

MASK = "<hidden>"


def job_secret(
    opts: HvdrunOptions, environ: Mapping[str, str] | None = None
) -> tuple[str | None, str | None]:
    """``(secret, warning)`` for this job: the secret (``None`` without one) and the line to print."""
    env = os.environ if environ is None else environ
    given = env.get(SECRET_ENV)
    if given:
        return given, None
    if not opts.multi_host or opts.use_mpi or not (opts.no_ssh or opts.this_host):
        return secrets.token_hex(16), None
    return None, (
        f"hvdrun: warning: no {SECRET_ENV} in the environment, so this job has no secret and any "
        "process that reaches the rendezvous port with the same command could join it. HINT: "
        f"export the same {SECRET_ENV} on every host first, e.g. "
        f"{SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(16))'), passed to each host."
    )


def masked(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the secret's value replaced by :data:`MASK` (for printing)."""
    return {k: (MASK if k == SECRET_ENV else v) for k, v in env.items()}

"""Runtime settings of the comm layer, and the one place that reads Horovod's environment knobs.

Launcher variables (rank, size, ...) are read by :func:`hvd_trainer.comm.world.world.detect_launch_env`;
everything else a ported Horovod job may set (``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_TIMELINE``,
``HOROVOD_STALL_CHECK_TIME_SECONDS``, ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``,
``HOROVOD_STALL_CHECK_DISABLE``, ``HOROVOD_GLOO_TIMEOUT_SECONDS``) is read here and nowhere else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CommConfig", "default_fusion_threshold_bytes", "fusion_threshold_is_set",
           "hierarchical_allreduce_env", "DEFAULT_FUSION_THRESHOLD_BYTES",
           "DEFAULT_PEER_TIMEOUT_SECONDS"]

_MIB = 1024 * 1024

DEFAULT_FUSION_THRESHOLD_BYTES = 16 * _MIB
"""Default bucket cap, chosen with ``bench/allreduce_fusion.py`` (ResNet-50's 102 MB of
gradients, 2 gloo processes on 2 CPU cores shared with other jobs). Median fused/flat ratios
in four runs: 16 MiB 1.06 / 1.16 / 1.22 / 1.65 (mean 1.27), 25 MiB 2.02 / 1.19 / 1.22 / 1.43
(1.47), 64 MiB 1.88 / 1.06 / 1.56 / 1.79 (1.57). The run-to-run noise (the flat allreduce
alone varied 108-228 ms) is as large as the differences, so no threshold is clearly best; 16
MiB had the best mean, smaller buckets start communicating earlier in backward, and with 9
buckets the per-collective cost (~0.5 ms for a tiny gloo allreduce here) stays negligible.
Horovod's default is 128 MiB, DDP's 25 MiB; ``HOROVOD_FUSION_THRESHOLD`` overrides it."""

DEFAULT_PEER_TIMEOUT_SECONDS = 10.0
"""Seconds of heartbeat silence after which a peer on another host counts as unreachable.

Only the heartbeat (:mod:`hvd_trainer.comm.world.heartbeat`, its own thread and store
connection) measures it, so a collective that runs long while its peers beat on is never cut
short. Horovod's ``HOROVOD_GLOO_TIMEOUT_SECONDS`` bounds one gloo operation (30 s); torchft's
lighthouse counts a replica dead after 5 s without a heartbeat; torchrun's c10d rendezvous after
its keep-alive's 3 x 5 s. Ten beats of one second each sit between those: a partition found in
10 s, while a process stalled under load (a long call that holds the GIL) has 10 s before it is
judged lost."""


def _env_float(env: Mapping[str, str], name: str, default: float) -> float:
    value = env.get(name)
    if value in (None, ""):
        return default
    try:
        return float(value)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r} is not a number of seconds. HINT: unset it.") from exc


def default_fusion_threshold_bytes(environ: Mapping[str, str] | None = None) -> int:
    """Fusion threshold in bytes: ``HOROVOD_FUSION_THRESHOLD`` when set, else 16 MiB.

    Raises:
        ValueError: the variable is not a non-negative integer.
    """
    env = os.environ if environ is None else environ
    value = env.get("HOROVOD_FUSION_THRESHOLD")
    if value in (None, ""):
        return DEFAULT_FUSION_THRESHOLD_BYTES
    try:
        parsed = int(value)
    except ValueError as exc:
        raise ValueError(
            f"HOROVOD_FUSION_THRESHOLD={value!r} is not an integer number of bytes. "
            "HINT: e.g. HOROVOD_FUSION_THRESHOLD=67108864 for 64 MiB."
        ) from exc
    if parsed < 0:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD={parsed} must be >= 0 (0 disables fusion).")
    return parsed


def fusion_threshold_is_set(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``HOROVOD_FUSION_THRESHOLD`` is set (non-empty): the user chose the bucket cap."""
    env = os.environ if environ is None else environ
    return env.get("HOROVOD_FUSION_THRESHOLD") not in (None, "")


def hierarchical_allreduce_env(environ: Mapping[str, str] | None = None) -> bool | None:
    """``HOROVOD_HIERARCHICAL_ALLREDUCE``: ``True``/``False`` when set (1/0, true/false), else None.

    Raises:
        ValueError: another value.
    """
    env = os.environ if environ is None else environ
    value = env.get("HOROVOD_HIERARCHICAL_ALLREDUCE", "").strip().lower()
    if value == "":
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"HOROVOD_HIERARCHICAL_ALLREDUCE={value!r}: expected 1 or 0. HINT: unset it for "
                     "the measured choice.")


REDUCESCATTER_GRAD_ENV = "HVD_TRAINER_REDUCESCATTER_GRAD"

MATCH_ASYNC_NAMES_ENV = "HVD_TRAINER_MATCH_ASYNC_NAMES"
"""``0`` turns off matching named ``*_async`` collectives by name (:attr:`CommConfig.match_async_names`)."""


def reducescatter_grad_horovod(environ: Mapping[str, str] | None = None) -> bool:
    """``HVD_TRAINER_REDUCESCATTER_GRAD``: ``adjoint`` (unset: the default) or ``horovod``.

    ``horovod`` makes the gradient of ``reducescatter`` what ``horovod.torch`` returns: the set
    size times the exact adjoint (``op=Sum``: size x the allgathered output gradients; ``op=Average``:
    the allgathered output gradients themselves), as Horovod's own ``test_horovod_reducescatter_grad``
    and ``..._grad_average`` expect. Read at each backward.

    Raises:
        ValueError: another value.
    """
    env = os.environ if environ is None else environ
    value = env.get(REDUCESCATTER_GRAD_ENV, "").strip().lower()
    if value in ("", "adjoint"):
        return False
    if value == "horovod":
        return True
    raise ValueError(f"{REDUCESCATTER_GRAD_ENV}={value!r}: expected 'adjoint' (the default: the exact "
                     "adjoint of the forward) or 'horovod' (Horovod's scale: the set size times it).")


@dataclass(kw_only=True, slots=True)
class CommConfig:
    """Cross-rank checks, stall inspection and the timeline."""

    check_signatures: bool = True
    """Compare each new collective signature across ranks (cached afterwards)."""
    mismatch_timeout_seconds: float = 30.0
    """Longest a rank waits for the others' signatures before reporting the missing ranks."""
    suspect_after_seconds: float = 1.0
    """A collective still running after this long publishes its signature so that ranks stuck in
    different collectives find each other and raise :class:`CollectiveMismatchError`."""
    stall_warning_seconds: float = 60.0
    """Warn (naming the missing ranks and the collective) after waiting this long. 0 disables."""
    stall_shutdown_seconds: float = 0.0
    """Raise :class:`StallError` after waiting this long; 0 never raises (Horovod's default)."""
    match_async_names: bool = True
    """Match a *named* ``*_async`` collective of the public API across ranks by its name, as
    Horovod's negotiation did, instead of by call order (:mod:`~hvd_trainer.comm.ops.by_name`):
    ranks may then start differently named ones in different orders. Unnamed collectives,
    blocking ones and the gradient reducer's buckets always match by call order.
    ``HVD_TRAINER_MATCH_ASYNC_NAMES=0`` matches named async ones by call order too (no side
    group, no matcher thread)."""
    timeline_path: str | None = None
    """Write a Chrome-trace JSON of every collective here (rank 0 only)."""
    peer_timeout_seconds: float = DEFAULT_PEER_TIMEOUT_SECONDS
    """A job on several hosts: a peer (or the job's store) silent this long counts as unreachable
    and every rank raises :class:`HostUnreachableError` (:mod:`~hvd_trainer.comm.world.heartbeat`).
    ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (hvdrun ``--gloo-timeout-seconds``) sets it; 0 disables."""

    def __post_init__(self) -> None:
        for name in ("mismatch_timeout_seconds", "suspect_after_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds.")
        for name in ("stall_warning_seconds", "stall_shutdown_seconds", "peer_timeout_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0 disables).")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> CommConfig:
        """Defaults, then Horovod's variables, then ``overrides`` (explicit arguments win)."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {
            "stall_warning_seconds": _env_float(env, "HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0),
            "stall_shutdown_seconds": _env_float(env, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0),
            "peer_timeout_seconds": _env_float(env, "HOROVOD_GLOO_TIMEOUT_SECONDS",
                                               DEFAULT_PEER_TIMEOUT_SECONDS),
        }
        match_names = env.get(MATCH_ASYNC_NAMES_ENV, "").strip().lower()
        if match_names in ("0", "false", "no"):
            values["match_async_names"] = False
        elif match_names not in ("", "1", "true", "yes"):
            raise ValueError(f"{MATCH_ASYNC_NAMES_ENV}={match_names!r}: expected 1 or 0. HINT: unset it "
                             "to match named async collectives by name (the default).")
        if env.get("HOROVOD_STALL_CHECK_DISABLE", "") not in ("", "0"):
            values["stall_warning_seconds"] = 0.0
            values["stall_shutdown_seconds"] = 0.0
        if env.get("HOROVOD_TIMELINE") and env["HOROVOD_TIMELINE"].upper() != "DYNAMIC":
            # DYNAMIC is Horovod's "start_timeline() will be called"; ours always allows it.
            values["timeline_path"] = env["HOROVOD_TIMELINE"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


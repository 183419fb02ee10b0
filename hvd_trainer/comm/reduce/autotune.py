"""Autotune of the gradient bucket layout (Horovod's ``HOROVOD_AUTOTUNE``), the search itself.

During the first steps of training the gradient reducer tries candidate bucket layouts on real
steps and keeps the fastest. This module holds the search and its settings; it sends nothing.
:class:`~hvd_trainer.comm.reduce.fusion.GradientReducer` times its steps, agrees on each sample across
ranks and switches layout (see there).

Search (a grid, not Horovod's Bayesian optimisation): the candidates are the fusion thresholds
1, 2, 4, ..., 256 MiB with a first bucket of 1 MiB or as large as the threshold, plus the
configured layout; candidates that put the gradients into the same buckets are tried once, so a
small model has only a few. The configured layout is tried first. Each candidate runs for
``warmup_steps_per_sample`` steps that are not timed (buffers allocated, caches warm), then
``steps_per_sample`` timed steps; a sample is the median step time of those steps on each rank,
and the *slowest* rank's median counts (every rank gets the same number, so every rank makes the
same decision at the same step). The first ``warmup_samples`` samples of the job (start-up:
first-call costs, lazy initialisation) are discarded and repeated. At most ``max_samples``
candidates take part. The search runs in ``rounds`` rounds of successive halving (Jamieson and
Talwalkar 2016, arXiv:1502.07943): every candidate is measured once, then the faster half again,
and so on; a candidate's score is the median of its samples. The best-scoring layout is then kept
for the rest of training and the search costs nothing more. Every sample is logged (rank 0)
as one CSV row when ``log_file`` is set; the choice is not a sample and is not a row:
:meth:`Autotuner.summary` says it in one line (the Lightning strategy prints it on rank 0).

Environment (read by :meth:`AutotuneConfig.from_env`, Horovod's names):
``HOROVOD_AUTOTUNE=1``, ``HOROVOD_AUTOTUNE_LOG=path.csv``, ``HOROVOD_AUTOTUNE_WARMUP_SAMPLES``
(default 3, Horovod's), ``HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE`` (default 10, Horovod's),
``HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`` (the most candidates tried; default 20, Horovod's).
"""

from __future__ import annotations

import csv
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AutotuneConfig", "Candidate", "Autotuner", "candidate_thresholds", "resolve_autotune",
           "LOG_COLUMNS"]

_MIB = 1024 * 1024

LOG_COLUMNS = ("sample", "round", "fusion_threshold_bytes", "first_bucket_bytes", "num_buckets",
               "step_seconds", "status")
"""Columns of the autotune CSV log, one row per sample (``sample`` numbers 1, 2, ...).
``status``: ``warmup`` (discarded) or ``sample``; or a single row ``only_layout`` (sample 0)
when every candidate buckets the gradients the same way: nothing to search."""


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / _MIB:g} MiB"


def _env_int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer. HINT: e.g. {name}={default}.") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}.")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class AutotuneConfig:
    """Settings of the bucket-layout search (see the module docstring)."""

    warmup_samples: int = 3
    """Samples discarded at the start of the job (Horovod's default: 3)."""
    steps_per_sample: int = 10
    """Timed steps per sample (Horovod's default: 10)."""
    warmup_steps_per_sample: int = 2
    """Untimed steps after each layout switch."""
    max_samples: int = 20
    """The most candidate layouts tried (Horovod's ``bayes_opt_max_samples`` default: 20)."""
    log_file: str | None = None
    """CSV file written by rank 0, one row per sample (:data:`LOG_COLUMNS`)."""
    rounds: int = 3
    """Rounds of successive halving: round 1 measures every candidate, each later round
    re-measures the faster half of the previous one (scores: the median of a candidate's
    samples), so one noisy sample cannot decide alone."""

    def __post_init__(self) -> None:
        for name in ("steps_per_sample", "max_samples", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"AutotuneConfig.{name}={getattr(self, name)} must be >= 1.")
        for name in ("warmup_samples", "warmup_steps_per_sample"):
            if getattr(self, name) < 0:
                raise ValueError(f"AutotuneConfig.{name}={getattr(self, name)} must be >= 0.")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, force: bool = False
                 ) -> AutotuneConfig | None:
        """The config ``HOROVOD_AUTOTUNE*`` asks for; ``None`` when ``HOROVOD_AUTOTUNE`` is unset/0
        (``force``: the settings of the other variables even then).

        Raises:
            ValueError: a variable that is not an integer or is out of range.
        """
        env = os.environ if environ is None else environ
        if not force and env.get("HOROVOD_AUTOTUNE", "") in ("", "0"):
            return None
        return cls(
            warmup_samples=_env_int(env, "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", 3, 0),
            steps_per_sample=_env_int(env, "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", 10, 1),
            max_samples=_env_int(env, "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", 20, 1),
            log_file=env.get("HOROVOD_AUTOTUNE_LOG") or None,
        )


def resolve_autotune(value: bool | AutotuneConfig | None) -> AutotuneConfig | None:
    """The one reading of an ``autotune=`` option: ``None`` -> ``HOROVOD_AUTOTUNE`` decides;
    ``True`` -> on, with the ``HOROVOD_AUTOTUNE_*`` settings (``hvdrun --autotune-log-file`` etc.);
    ``False`` -> off; an :class:`AutotuneConfig` -> itself.

    Raises:
        TypeError: any other value. ValueError: a bad ``HOROVOD_AUTOTUNE_*`` variable.
    """
    if value is None:
        return AutotuneConfig.from_env()
    if value is True:
        return AutotuneConfig.from_env(force=True)
    if value is False:
        return None
    if isinstance(value, AutotuneConfig):
        return value
    raise TypeError(f"autotune={value!r} must be True, False, None or an AutotuneConfig.")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One bucket layout to try."""

    fusion_threshold_bytes: int
    first_bucket_bytes: int
    num_buckets: int


def candidate_thresholds(configured: tuple[int, int]) -> list[tuple[int, int]]:
    """``(fusion_threshold_bytes, first_bucket_bytes)`` pairs to try, the configured one first."""
    pairs = [configured]
    for k in range(9):  # 1 MiB .. 256 MiB
        threshold = (1 << k) * _MIB
        for first in (_MIB, threshold):
            if (threshold, first) not in pairs:
                pairs.append((threshold, first))
    return pairs


class Autotuner:
    """Walks the candidates one sample at a time, in rounds of successive halving.

    Usage (by the reducer, identically on every rank): call :meth:`record` with each step's
    duration; when it returns True, agree on :meth:`local_sample` across ranks (the maximum) and
    pass that to :meth:`advance`, which returns the candidate to use from the next step on.

    Args:
        candidates: distinct layouts, the configured one first.
        config: the search settings.
        rank: this process's rank (rank 0 writes the log).
    """

    def __init__(self, candidates: Sequence[Candidate], config: AutotuneConfig, rank: int = 0) -> None:
        if not candidates:
            raise ValueError("Autotuner needs at least one candidate layout.")
        self.candidates = list(candidates)[: config.max_samples]
        self.config = config
        self.rank = rank
        self.samples: dict[int, list[float]] = {}
        self.round = 0
        self.done = len(self.candidates) == 1
        self._order = list(range(len(self.candidates)))  # this round's candidates, in order
        self._pos = 0
        self._chosen = 0
        self._warmups_left = config.warmup_samples
        self._skip = config.warmup_steps_per_sample
        self._times: list[float] = []
        self._sample_no = 0
        if config.log_file and rank == 0:
            Path(config.log_file).parent.mkdir(parents=True, exist_ok=True)
            with open(config.log_file, "w", newline="") as f:
                csv.writer(f).writerow(LOG_COLUMNS)
            if self.done:  # nothing to search: say so instead of leaving no file
                self._log(self.candidates[0], float("nan"), "only_layout")

    @property
    def current(self) -> int:
        """Index of the candidate in use."""
        return self._chosen if self.done else self._order[self._pos]

    def score(self, index: int) -> float:
        """Median of the candidate's agreed samples, seconds (inf before any)."""
        got = self.samples.get(index)
        return statistics.median(got) if got else float("inf")

    @property
    def best(self) -> Candidate:
        """The chosen candidate once done; before that the best measured so far (the
        configured one before any sample)."""
        if self.done or not self.samples:
            return self.candidates[self._chosen]
        return self.candidates[min(self.samples, key=lambda i: (self.score(i), i))]

    def record(self, step_seconds: float) -> bool:
        """Add one step's duration (seconds). True when a sample is complete (agree on it now)."""
        if self.done:
            return False
        if self._skip > 0:
            self._skip -= 1
            return False
        self._times.append(step_seconds)
        return len(self._times) >= self.config.steps_per_sample

    def local_sample(self) -> float:
        """This rank's median step time of the sample just completed, seconds."""
        return statistics.median(self._times)

    def advance(self, agreed_seconds: float) -> Candidate | None:
        """Take the agreed (slowest rank's) sample; return the layout for the next steps, or
        ``None`` to keep the current one."""
        self._times = []
        self._skip = self.config.warmup_steps_per_sample
        self._sample_no += 1
        index = self.current
        if self._warmups_left > 0:
            self._warmups_left -= 1
            self._log(self.candidates[index], agreed_seconds, "warmup")
            return None
        self.samples.setdefault(index, []).append(agreed_seconds)
        self._log(self.candidates[index], agreed_seconds, "sample")
        self._pos += 1
        if self._pos < len(self._order):
            return self.candidates[self._order[self._pos]]
        return self._next_round()

    def _next_round(self) -> Candidate:
        """Keep the faster half of this round's candidates; finish when one is left or after
        ``rounds`` rounds."""
        self.round += 1
        ranked = sorted(self._order, key=lambda i: (self.score(i), i))
        keep = ranked[: max(1, (len(ranked) + 1) // 2)]
        if len(keep) == 1 or self.round >= self.config.rounds:
            self.done = True
            self._chosen = ranked[0]
            return self.candidates[self._chosen]
        self._order, self._pos = sorted(keep), 0
        return self.candidates[self._order[0]]

    def summary(self) -> str:
        """One line on the chosen layout (after :attr:`done`), e.g. ``autotune: chose fusion
        threshold 16 MiB, first bucket 1 MiB (2 buckets): median step 0.4245 s, the fastest of 3
        layouts over 2 rounds, 5 samples``."""
        best = self.best
        buckets = f"{best.num_buckets} bucket{'s' * (best.num_buckets != 1)}"
        layout = (f"fusion threshold {_mib(best.fusion_threshold_bytes)}, first bucket "
                  f"{_mib(best.first_bucket_bytes)} ({buckets})")
        if len(self.candidates) == 1:
            return f"autotune: {layout}, the only layout of these gradients: nothing to search"
        if not self.done:
            return f"autotune: still searching; fastest so far {layout}"
        samples = sum(len(v) for v in self.samples.values())
        return (f"autotune: chose {layout}: median step {self.score(self._chosen):.4f} s, the fastest "
                f"of {len(self.candidates)} layouts over {self.round} round{'s' * (self.round != 1)}, "
                f"{samples} samples")

    def _log(self, cand: Candidate, seconds: float, status: str) -> None:
        if not self.config.log_file or self.rank != 0:
            return
        with open(self.config.log_file, "a", newline="") as f:
            csv.writer(f).writerow([self._sample_no, self.round, cand.fusion_threshold_bytes,
                                    cand.first_bucket_bytes, cand.num_buckets, f"{seconds:.6f}", status])

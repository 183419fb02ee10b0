"""The recipes' ``strategy=`` argument from their ``trainer.*`` keys: the name Lightning knows,
or a configured :class:`~hvd_trainer.strategy.HorovodStrategy` when a slow-link option is set
(``trainer.sync_every``: DiLoCo local steps; ``trainer.compression``: the gradient wire format).

The recipes' config schemas (``_gpt_config``, ``_digits_config``) import this module for
:func:`check_slow_link_keys`, and ``hvd-train`` reads them without importing Lightning: so
:class:`~hvd_trainer.strategy.HorovodStrategy` is imported only when :func:`build_strategy`
builds one."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hvd_trainer.strategy import HorovodStrategy

__all__ = ["SLOW_LINK_KEYS_DOC", "build_strategy", "check_slow_link_keys"]

SLOW_LINK_KEYS_DOC = ("trainer.sync_every, trainer.outer_lr, trainer.outer_momentum, "
                      "trainer.outer_overlap_steps, trainer.outer_fragments, trainer.sync_warmup_steps, "
                      "trainer.compression")


_OUTER_KEYS = ("outer_lr", "outer_momentum", "outer_overlap_steps", "outer_fragments", "sync_warmup_steps")
"""The keys of the outer loop, which runs only with local steps."""


def check_slow_link_keys(cfg: Any) -> None:
    """Validate ``cfg`` (a recipe's TrainerConfig) in ``__post_init__``.

    Raises:
        ValueError: ``sync_every`` neither an int >= 0 nor "auto", ``sync_warmup_steps`` below -1,
            an outer-loop key away from its default without ``sync_every``, ``compression=auto``
            with an int ``sync_every`` (auto chooses the gradients' format; local steps have none),
            or a slow-link option with a strategy other than "horovod".
    """
    auto = cfg.sync_every == "auto"
    if not auto and (not isinstance(cfg.sync_every, int) or cfg.sync_every < 0):
        raise ValueError(f"trainer.sync_every={cfg.sync_every!r} must be an int >= 0 (0: synchronous) "
                         "or auto (chosen from the measured link and the step's compute).")
    warmup = cfg.sync_warmup_steps
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < -1:
        raise ValueError(f"trainer.sync_warmup_steps={warmup!r} must be an int >= 0 (steps averaged one by "
                         "one before local steps begin) or -1 (the library's default, 128). HINT: 0 starts "
                         "local steps at once.")
    if not cfg.sync_every:  # no local steps can run (compression=auto alone never chooses them)
        defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
        given = [f"trainer.{k}={getattr(cfg, k)!r}" for k in _OUTER_KEYS if getattr(cfg, k) != defaults[k]]
        if given:
            raise ValueError(f"{', '.join(given)} set without trainer.sync_every: the outer loop runs "
                             "only with local steps, so this would change nothing. HINT: add "
                             "trainer.sync_every=32 (or auto), or drop it.")
    if cfg.compression == "auto" and cfg.sync_every and not auto:
        raise ValueError(f"trainer.compression=auto with trainer.sync_every={cfg.sync_every}: auto chooses "
                         "the gradients' wire format, and local steps reduce no gradients. HINT: "
                         "trainer.sync_every=auto too, or the outer gradient's trainer.compression "
                         "(none, bf16 or int8).")
    if cfg.strategy != "horovod" and (cfg.sync_every or cfg.compression != "none"):
        raise ValueError(
            f"trainer.sync_every / trainer.compression need trainer.strategy=horovod, got "
            f"trainer.strategy={cfg.strategy!r}."
        )


def build_strategy(cfg: Any) -> str | HorovodStrategy:
    """``cfg.strategy`` itself, or ``HorovodStrategy(sync_every=..., compression=...,
    zero_stage=...)`` when a slow-link key or ``zero_stage`` differs from its default."""
    zero_stage = getattr(cfg, "zero_stage", 0)  # a key of the recipes that have it (gpt)
    if cfg.strategy != "horovod" or (not cfg.sync_every and cfg.compression == "none" and not zero_stage):
        return cfg.strategy
    from hvd_trainer.strategy import HorovodStrategy  # Lightning: only for a run

    return HorovodStrategy(
        sync_every=cfg.sync_every or None, outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum,
        outer_overlap_steps=cfg.outer_overlap_steps, outer_fragments=cfg.outer_fragments,
        sync_warmup_steps=None if cfg.sync_warmup_steps == -1 else cfg.sync_warmup_steps,
        compression=cfg.compression, zero_stage=zero_stage,
        zero_overlap_exchange=getattr(cfg, "zero_overlap_exchange", False),
    )

"""``hvd-train recipe=NAME [key=value ...]``: run a recipe with omegaconf overrides.

A recipe is a module ``recipes/<NAME>.py`` that defines a dataclass ``Config`` (the schema)
and ``run(cfg: Config) -> dict`` returning at least ``world_size`` and ``wall_s`` plus the
metrics that mean something for it (:data:`RESULT_FIELDS`). Settings are merged in this order:
the dataclass defaults, ``conf/<NAME>.yaml``, then the command-line dotlist. Global rank 0 prints
one ``RESULT`` line (under torchrun/hvdrun, mpirun, srun or Lightning's self-launch alike).

    hvd-train --help                        the recipes
    hvd-train recipe=NAME --help            every key of NAME's config: type, value, default, docstring
    hvd-train recipe=NAME --print-config    the merged config as YAML (key=value overrides included)
"""

from __future__ import annotations

import dataclasses
import difflib
import gc
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from hvd_trainer.comm.base.launch_env import launcher_rank
from hvd_trainer.comm.session import shutdown
from hvd_trainer.launch.config_help import format_keys, list_recipes

__all__ = ["ConfigError", "load_config", "main", "format_result"]

RECIPE_PACKAGES = ("hvd_trainer.recipes", "recipes")
"""Where recipes are imported from, first found wins: an installed wheel carries the repository's
``recipes/`` as ``hvd_trainer.recipes``; a checkout (editable install or ``PYTHONPATH``) has the
top-level ``recipes`` package."""


def _conf_dir() -> Path:
    """The recipes' YAML folder: ``hvd_trainer/conf`` of an installed wheel (the repository's
    ``conf/``, installed as package data), else ``conf/`` of the checkout this file is in."""
    spec = importlib.util.find_spec("hvd_trainer.conf")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / "conf"


CONF_DIR = _conf_dir()
RESULT_KEYS = ("world_size", "wall_s")
"""Fields every recipe's result must have."""
RESULT_FIELDS = {
    "world_size": "{:d}", "val_acc": "{:.2f}", "epochs": "{:d}", "samples_per_s": "{:.1f}",
    "wall_s": "{:.1f}",
    "val_loss": "{:.4f}", "unigram_loss": "{:.4f}", "tokens_per_s": "{:.1f}", "steps": "{:d}",
}
"""Known RESULT fields and their formats, in the order printed; a recipe returns those that mean
something for it (a classifier ``val_acc``/``epochs``/``samples_per_s``, a language model
``val_loss``/``unigram_loss``/``tokens_per_s``/``steps``). Any other field follows them, as ``{:g}``."""


class ConfigError(ValueError):
    """A config key that does not exist or a value of the wrong type."""


def _valid_keys(schema: Any, prefix: str = "") -> list[str]:
    keys: list[str] = []
    for f in dataclasses.fields(schema):
        name = f"{prefix}{f.name}"
        value = getattr(schema, f.name) if not isinstance(schema, type) else None
        ftype = f.type if not isinstance(f.type, str) else None
        sub = value if dataclasses.is_dataclass(value) else ftype
        if sub is not None and dataclasses.is_dataclass(sub):
            keys += _valid_keys(sub, name + ".")
        else:
            keys.append(name)
    return keys


def load_config(schema: type, yaml_path: Path | None, overrides: Sequence[str]) -> Any:
    """Merge ``schema`` defaults, the YAML file and the dotlist; return a ``schema`` instance.

    Raises:
        ConfigError: an unknown key (the message lists the valid keys), a wrong type (the key
            is named) or a value the schema's ``__post_init__`` rejects.
    """
    base = OmegaConf.structured(schema)
    valid = _valid_keys(schema())
    try:
        if yaml_path is not None and yaml_path.exists():
            base = OmegaConf.merge(base, OmegaConf.load(yaml_path))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"overrides must look like key=value, got {bad}.")
        base = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(base)
    except ConfigError:
        raise
    except ConfigKeyError as exc:
        key = getattr(exc, "full_key", None) or str(exc).splitlines()[0]
        close = difflib.get_close_matches(str(key), valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown config key {key!r}{hint}. Valid keys: {', '.join(valid)}"
        ) from None
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        where = f" for {key!r}" if key else ""
        raise ConfigError(f"invalid value{where}: {str(exc).splitlines()[0]}") from None
    except ValueError as exc:  # a schema's __post_init__ range check
        raise ConfigError(str(exc)) from None


def format_result(result: dict[str, Any]) -> str:
    """One ``RESULT key=value ...`` line of the fields the recipe returned: those of
    :data:`RESULT_FIELDS` in its order and format, then any others, e.g.
    ``RESULT world_size=2 val_acc=0.97 epochs=20 samples_per_s=1234.5 wall_s=42.0`` (digits) or
    ``RESULT world_size=2 wall_s=98.6 val_loss=2.1251 unigram_loss=3.3222 tokens_per_s=22607.8
    steps=500`` (gpt, one line).

    Raises:
        ValueError: a field of :data:`RESULT_KEYS` is missing.
    """
    missing = [k for k in RESULT_KEYS if k not in result]
    if missing:
        raise ValueError(f"recipe result lacks {missing}; it must return at least {RESULT_KEYS}.")
    parts = []
    for key, fmt in RESULT_FIELDS.items():
        if key in result:
            value = int(result[key]) if fmt == "{:d}" else float(result[key])
            parts.append(f"{key}={fmt.format(value)}")
    parts += [f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
              for key, value in result.items() if key not in RESULT_FIELDS]
    return "RESULT " + " ".join(parts)


def _split_args(argv: Sequence[str]) -> tuple[str, list[str]]:
    recipe = None
    rest: list[str] = []
    for arg in argv:
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if not recipe:
        raise ConfigError("no recipe given. HINT: hvd-train recipe=digits trainer.max_epochs=5")
    return recipe, rest


def _recipe_package() -> str:
    """The first of :data:`RECIPE_PACKAGES` that exists, preferring the one that ships with this
    copy of hvd_trainer: a second checkout (a git worktree on ``PYTHONPATH``) next to an editable
    install of another must run its own recipes, not the installed checkout's."""
    here = Path(__file__).resolve().parents[2]  # the checkout, or site-packages for a wheel
    found = [(package, spec) for package in RECIPE_PACKAGES
             if (spec := importlib.util.find_spec(package)) is not None]
    for package, spec in found:
        for location in spec.submodule_search_locations or ():
            if Path(location).resolve().parent in (here, here / "hvd_trainer"):
                return package
    return found[0][0] if found else RECIPE_PACKAGES[-1]


def _import_recipe(name: str) -> ModuleType:
    """Import recipe ``name`` from the first of :data:`RECIPE_PACKAGES` that exists.

    Raises:
        ConfigError: there is no such recipe (the message lists the available ones).
    """
    package = _recipe_package()
    parent = importlib.import_module(package)
    available = [n for n, _ in list_recipes(list(parent.__path__))]
    if name.startswith("_"):  # a recipe's helper module, not a recipe
        raise ConfigError(f"no recipe {name!r}; available: {available}")
    try:
        return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{package}.{name}":
            raise
        raise ConfigError(f"no recipe {name!r}; available: {available}") from None


def _print_help(recipe: str | None, overrides: list[str]) -> None:
    """``--help``: the usage and the recipes; with ``recipe=NAME`` that recipe's keys."""
    if recipe is None:
        package = importlib.import_module(_recipe_package())
        rows = list_recipes(list(package.__path__))
        width = max((len(name) for name, _ in rows), default=0)
        print(__doc__.strip() + "\n\nRecipes (hvd-train recipe=NAME --help lists its keys):")
        print("\n".join(f"  {name:<{width}}  {summary}" for name, summary in rows))
        return
    module = _import_recipe(recipe)
    yaml_path = CONF_DIR / f"{recipe}.yaml"
    merged = load_config(module.Config, yaml_path, overrides)
    summary = (module.__doc__ or "").strip().splitlines()
    print(f"hvd-train recipe={recipe} [key=value ...]" + (f": {summary[0]}" if summary else ""))
    print(f"Keys (schema {module.__name__}.Config < {yaml_path.name} < command line):")
    print(format_keys(module.Config, merged, yaml_path.name))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hvd-train``. Returns 0 on success, 2 on a config error.

    ``--help`` / ``-h`` lists the recipes (with ``recipe=NAME``: every key of that recipe with
    its type, value, default and docstring); ``--print-config`` prints the merged config as
    YAML and exits without training.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = any(a in ("-h", "--help") for a in argv)
    print_config = "--print-config" in argv
    argv = [a for a in argv if a not in ("-h", "--help", "--print-config")]
    try:
        if wants_help:
            recipe = next((a.split("=", 1)[1] for a in argv if a.startswith("recipe=")), None)
            _print_help(recipe, [a for a in argv if not a.startswith("recipe=")])
            return 0
        name, overrides = _split_args(argv)
        module = _import_recipe(name)
        cfg = load_config(module.Config, CONF_DIR / f"{name}.yaml", overrides)
    except ConfigError as exc:
        print(f"hvd-train: error: {exc}", file=sys.stderr)
        return 2
    if print_config:
        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")
        return 0
    result = module.run(cfg)
    if result is not None and launcher_rank() == 0:  # RANK alone misses mpirun and srun
        print(format_result(result), flush=True)
    # Only after a successful run (after an error, peers may still sit in a collective and
    # the destroy would hang): Lightning's own DDP leaves its gloo group alive, and one that
    # is finalised with the interpreter sometimes aborts the process (exit 134) after a run
    # that printed its RESULT.
    shutdown()
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())

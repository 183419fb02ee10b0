"""``hvd-train recipe=NAME [key=value ...]``: run a recipe with omegaconf overrides.

A recipe is a module ``recipes/<NAME>.py`` that defines a dataclass ``Config`` (the schema)
and ``run(cfg: Config) -> dict`` returning at least ``world_size`` and ``wall_s`` plus the
metrics that mean something for it (:data:`RESULT_FIELDS`). Settings are merged in this order:
the dataclass defaults, ``conf/<NAME>.yaml``, then the command-line dotlist. Global rank 0 prints
one ``RESULT`` line (under torchrun/hvdrun, mpirun, srun or Lightning's self-launch alike).
A recipe whose imports are heavy (torch, Lightning) imports ``Config`` from a light sibling module
(``from ._NAME_config import Config``, as gpt and digits do): the config is read and checked
there, before the recipe is imported. Help, the config and config errors are printed by global
rank 0 alone; every rank exits with the same status.

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

from hvd_trainer.launch.config_help import format_keys, list_recipes, schema_module

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
LAUNCH_ENV_FILE = Path(__file__).resolve().parents[1] / "comm" / "base" / "launch_env.py"
""":mod:`hvd_trainer.comm.base.launch_env`, the one reader of launcher variables (standard library
only), loaded from its file where importing it by name would import ``hvd_trainer.comm`` (torch)."""
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


def _recipe_package_paths() -> tuple[str, list[str]]:
    """The recipe package's name (:func:`_recipe_package`) and its folders."""
    package = _recipe_package()
    return package, list(importlib.import_module(package).__path__)


def _import_recipe(name: str) -> ModuleType:
    """Import recipe ``name`` from the first of :data:`RECIPE_PACKAGES` that exists.

    Raises:
        ConfigError: there is no such recipe (the message lists the available ones).
    """
    package, paths = _recipe_package_paths()
    available = [n for n, _ in list_recipes(paths)]
    if name.startswith("_"):  # a recipe's helper module, not a recipe
        raise ConfigError(f"no recipe {name!r}; available: {available}")
    try:
        return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{package}.{name}":
            raise
        raise ConfigError(f"no recipe {name!r}; available: {available}") from None


def _recipe_schema(name: str) -> type:
    """Recipe ``name``'s ``Config``, imported from the module that defines it
    (:func:`~hvd_trainer.launch.config_help.schema_module`: ``_gpt_config`` for ``gpt``) without
    importing the recipe, whose frameworks a config error or ``--print-config`` does not need.
    Where the recipe defines ``Config`` itself, or its source does not say where it comes from,
    the recipe is imported and its ``Config`` returned.

    Raises:
        ConfigError: there is no such recipe (the message lists the available ones).
    """
    package, paths = _recipe_package_paths()
    module = None if name.startswith("_") else schema_module(paths, name)
    if module is None:
        return _import_recipe(name).Config
    return importlib.import_module(f"{package}.{module}").Config


def _load_recipe_config(name: str, overrides: list[str]) -> Any:
    """Recipe ``name``'s config: its ``Config`` < ``conf/<name>.yaml`` < ``overrides``.

    Raises:
        ConfigError: see :func:`load_config` (with a ``HINT:`` to the recipe's ``--help``) and
            :func:`_recipe_schema`.
    """
    schema = _recipe_schema(name)
    try:
        return load_config(schema, CONF_DIR / f"{name}.yaml", overrides)
    except ConfigError as exc:
        raise ConfigError(f"{exc}\nHINT: hvd-train recipe={name} --help lists every key with its "
                          "type, value, default and meaning.") from None


def _help_text(recipe: str | None, overrides: list[str]) -> str:
    """``--help``: the usage and the recipes; with ``recipe=NAME`` that recipe's keys."""
    _, paths = _recipe_package_paths()
    rows = list_recipes(paths)
    if recipe is None:
        width = max((len(name) for name, _ in rows), default=0)
        return "\n".join([__doc__.strip() + "\n\nRecipes (hvd-train recipe=NAME --help lists its keys):",
                          *(f"  {name:<{width}}  {summary}" for name, summary in rows)])
    schema = _recipe_schema(recipe)
    yaml_path = CONF_DIR / f"{recipe}.yaml"
    merged = load_config(schema, yaml_path, overrides)
    summary = dict(rows).get(recipe, "")
    return "\n".join([
        f"hvd-train recipe={recipe} [key=value ...]" + (f": {summary}" if summary else ""),
        f"Keys (schema {schema.__module__}.{schema.__qualname__} < {yaml_path.name} < command line):",
        format_keys(schema, merged, yaml_path.name),
    ])


def _launch_env() -> ModuleType:
    """:mod:`hvd_trainer.comm.base.launch_env` as imported, else loaded alone from
    :data:`LAUNCH_ENV_FILE` (once), so that deciding who prints imports no torch."""
    for name in ("hvd_trainer.comm.base.launch_env", "_hvd_train_launch_env"):
        if name in sys.modules:
            return sys.modules[name]
    spec = importlib.util.spec_from_file_location("_hvd_train_launch_env", LAUNCH_ENV_FILE)
    assert spec is not None and spec.loader is not None, LAUNCH_ENV_FILE
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def _global_rank() -> int:
    """This process's global rank as its launcher reported it (``launcher_rank``: RANK alone misses
    mpirun and srun); 0 when a rank variable is malformed, so that the error is printed."""
    try:
        return _launch_env().launcher_rank()
    except ValueError:  # LaunchEnvError; a run reports it
        return 0


def _say(text: str, *, error: bool = False, end: str = "\n") -> None:
    """Print ``text`` (to stderr when ``error``) on global rank 0 only."""
    if _global_rank() == 0:
        print(text, file=sys.stderr if error else sys.stdout, end=end, flush=True)


def _run(name: str, cfg: Any) -> int:
    """Import recipe ``name`` (and with it its frameworks), run it on ``cfg``, print ``RESULT``
    on global rank 0; 0."""
    from hvd_trainer.comm import shutdown  # torch: only once a run starts

    result = _import_recipe(name).run(cfg)
    if result is not None:
        _say(format_result(result))
    # Only after a successful run (after an error, peers may still sit in a collective and
    # the destroy would hang): Lightning's own DDP leaves its gloo group alive, and one that
    # is finalised with the interpreter sometimes aborts the process (exit 134) after a run
    # that printed its RESULT.
    shutdown()
    gc.collect()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hvd-train``. Returns 0 on success, 2 on a config error.

    ``--help`` / ``-h`` lists the recipes (with ``recipe=NAME``: every key of that recipe with
    its type, value, default and docstring); ``--print-config`` prints the merged config as
    YAML and exits without training. Both, and a config error, read the recipe's ``Config``
    without importing the recipe (:func:`_recipe_schema`) and print on global rank 0 only; the
    other ranks return the same status silently.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = any(a in ("-h", "--help") for a in argv)
    print_config = "--print-config" in argv
    argv = [a for a in argv if a not in ("-h", "--help", "--print-config")]
    try:
        if wants_help:
            recipe = next((a.split("=", 1)[1] for a in argv if a.startswith("recipe=")), None)
            _say(_help_text(recipe, [a for a in argv if not a.startswith("recipe=")]))
            return 0
        name, overrides = _split_args(argv)
        cfg = _load_recipe_config(name, overrides)
    except ConfigError as exc:
        _say(f"hvd-train: error: {exc}", error=True)
        return 2
    if print_config:
        _say(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")
        return 0
    return _run(name, cfg)


if __name__ == "__main__":
    sys.exit(main())

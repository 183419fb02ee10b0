"""What ``hvd-train --help`` prints: the recipes, and every key of one recipe's config.

A recipe's schema is a tree of dataclasses whose fields carry a docstring on the line after
them (the torchtitan convention); Python keeps no such docstrings at run time, so they are read
from the class's source with :mod:`ast`. Recipes are listed from their files' module docstrings,
without importing them (a Keras recipe would import TensorFlow), and so is the module that
defines a recipe's ``Config`` (:func:`schema_module`): ``hvd-train`` reads and checks a config
without importing the recipe's frameworks.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pkgutil
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["KeyHelp", "field_docs", "iter_keys", "format_keys", "list_recipes", "schema_module"]


@dataclass(frozen=True, slots=True)
class KeyHelp:
    """One leaf key of a config: dotted name, type name, value after the YAML, schema default,
    docstring ("" when it has none)."""

    key: str
    type_name: str
    value: Any
    default: Any
    doc: str


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: docstring}`` of dataclass ``cls``, read from its source (``{}`` when the
    source is not available, e.g. a class made at run time)."""
    try:
        tree = ast.parse(inspect.getsource(cls).lstrip())
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        text = after.value.value if is_doc else None
        if isinstance(text, str):
            docs[node.target.id] = inspect.cleandoc(text).replace("\n", " ")
    return docs


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def iter_keys(schema: type, merged: Any, prefix: str = "") -> Iterator[KeyHelp]:
    """Every leaf key of dataclass ``schema`` in field order; ``merged`` is the config after the
    YAML file (an instance of ``schema``), whose values are shown next to the defaults."""
    hints = typing.get_type_hints(schema)
    docs = field_docs(schema)
    defaults = schema()
    for f in dataclasses.fields(schema):
        tp = hints.get(f.name, f.type)
        value = getattr(merged, f.name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from iter_keys(tp, value, f"{prefix}{f.name}.")
        else:
            yield KeyHelp(f"{prefix}{f.name}", _type_name(tp), value, getattr(defaults, f.name),
                          docs.get(f.name, ""))


def format_keys(schema: type, merged: Any, yaml_name: str) -> str:
    """One block per key: ``key: type = value`` (and the schema default when ``yaml_name``
    changed it), then the docstring indented below."""
    lines: list[str] = []
    for k in iter_keys(schema, merged):
        line = f"  {k.key}: {k.type_name} = {k.value!r}"
        if k.value != k.default:
            line += f"  (from {yaml_name} or the command line; schema default {k.default!r})"
        lines.append(line)
        if k.doc:
            lines.append(f"      {k.doc}")
    return "\n".join(lines)


def _module_summary(path: Path) -> str:
    """The first line of a module file's docstring, without importing it."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except (OSError, SyntaxError):
        return ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def list_recipes(package_paths: list[str]) -> list[tuple[str, str]]:
    """``(name, summary)`` of every public recipe module (names not starting with ``_``) in the
    recipe package folders ``package_paths``, sorted by name."""
    found: dict[str, str] = {}
    for info in pkgutil.iter_modules(package_paths):
        if info.name.startswith("_") or info.ispkg:
            continue
        found.setdefault(info.name, _module_summary(Path(info.module_finder.path) / f"{info.name}.py"))
    return sorted(found.items())


def _config_origin(tree: ast.Module) -> str | None:
    """Where module ``tree`` gets its ``Config``: ``""`` when it defines the class, the sibling
    module's name for ``from .other import Config``, else ``None``."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Config":
            return ""
        is_sibling = isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        if is_sibling and any(a.name == "Config" and a.asname in (None, "Config") for a in node.names):
            return node.module
    return None


def schema_module(package_paths: list[str], name: str) -> str | None:
    """The module of the recipe package (folders ``package_paths``) that defines recipe ``name``'s
    ``Config``, read from the sources without importing them: ``name`` itself when its file has
    ``class Config``, else the module its ``from .other import Config`` names, followed the same
    way (``gpt_gpu`` -> ``gpt`` -> ``_gpt_config``).

    Returns ``None`` when there is no such file, or a source neither defines nor imports ``Config``
    that way (a caller then imports the recipe itself).
    """
    seen: set[str] = set()
    while name not in seen:
        seen.add(name)
        files = [Path(p) / f"{name}.py" for p in package_paths]
        path = next((f for f in files if f.is_file()), None)
        try:
            origin = _config_origin(ast.parse(path.read_text(encoding="utf-8"))) if path else None
        except (OSError, SyntaxError, UnicodeDecodeError):
            return None
        if origin is None:
            return None
        if origin == "":
            return name
        name = origin
    return None  # the sources import Config from each other in a cycle

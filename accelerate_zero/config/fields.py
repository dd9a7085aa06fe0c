"""Per-field validation of config blocks: each value checked against its annotation and constraints, and normalized
("5e8" and 5e8 -> 500000000, "warn" -> "WARN"). Every block runs `normalize_fields` in `__post_init__`."""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from accelerate_zero.config.values import is_auto, join_path


INVALID = object()
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def normalize_fields(block: Any) -> list[str]:
    """Validates and normalizes every field of a config block in place; returns one problem per bad field."""
    problems: list[str] = []
    hints = type_hints(type(block))
    for f in dataclasses.fields(block):
        path = join_path(block._PATH, f.name)
        value, problem = coerce_value(path, getattr(block, f.name), hints[f.name], f.metadata)
        if problem is not None:
            problems.append(problem)
        else:
            setattr(block, f.name, value)
    return problems


_TYPE_HINTS: dict[type, dict[str, Any]] = {}


def type_hints(cls: type) -> dict[str, Any]:
    if cls not in _TYPE_HINTS:
        _TYPE_HINTS[cls] = typing.get_type_hints(cls)
    return _TYPE_HINTS[cls]


def is_block_type(hint: Any) -> typing.TypeGuard[type]:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def split_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def parse_number(value: Any) -> int | float | None:
    """`value` as a number if it is one (bools excluded) or a numeric string ("5e8", "3e-5"), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):  # also numpy integers
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        text = value.strip()
        return int(text) if text.lstrip("+-").isdigit() else float(text)
    return None


def coerce_value(path: str, value: Any, hint: Any, meta: Mapping[str, Any]) -> tuple[Any, str | None]:
    """Checks one value against its annotation and the constraints in `meta` (ge, le, gt, case, inf_is_none).

    Returns:
        (normalized value, None), or (value, a problem naming the key, showing the value and what is allowed).
    """
    base, optional = split_optional(hint)
    if meta.get("inf_is_none") and isinstance(value, float) and value == math.inf:
        return None, None
    if value is None and optional:
        return None, None
    if is_block_type(base):
        if isinstance(value, base):
            return value, None
        return value, f"{path}={value!r}: expected a {base.__name__} (build configs with ZeroConfig.from_any)"
    if is_auto(value):
        return value, None
    converted = _convert(value, base, meta)
    if converted is INVALID or not _in_range(converted, meta):
        return value, f"{path}={value!r}: expected {_describe(base, meta)}" + (" or null" if optional else "")
    return converted, None


def _convert(value: Any, base: Any, meta: Mapping[str, Any]) -> Any:
    if base is bool:
        return value if isinstance(value, bool) else INVALID
    if base is int or base is float:
        number = parse_number(value)
        if number is None or not math.isfinite(number):
            return INVALID
        if base is float:
            return float(number)
        return int(number) if float(number).is_integer() else INVALID
    if base is str:
        return os.fspath(value) if isinstance(value, str | Path) else INVALID
    if typing.get_origin(base) is Literal:
        if isinstance(value, str) and meta.get("case"):
            value = value.upper() if meta["case"] == "upper" else value.lower()
        return value if isinstance(value, str) and value in typing.get_args(base) else INVALID
    if typing.get_origin(base) is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            return INVALID
        return {k: _numeric(v) if meta.get("numeric_strings") else copy.deepcopy(v) for k, v in value.items()}
    if typing.get_origin(base) is list:
        items = [value] if isinstance(value, str) else value
        ok = isinstance(items, list | tuple) and all(isinstance(v, str) for v in items)
        return list(items) if ok else INVALID
    return INVALID


def _numeric(value: Any) -> Any:
    """Numeric strings (YAML reads 3e-5 as a string) -> numbers, also inside lists; anything else unchanged."""
    if isinstance(value, list | tuple):
        return [_numeric(v) for v in value]
    number = parse_number(value) if isinstance(value, str) else None
    return copy.deepcopy(value) if number is None else number


def _in_range(value: Any, meta: Mapping[str, Any]) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return True
    return (
        ("ge" not in meta or value >= meta["ge"])
        and ("le" not in meta or value <= meta["le"])
        and ("gt" not in meta or value > meta["gt"])
    )


def _describe(base: Any, meta: Mapping[str, Any]) -> str:
    if base is bool:
        return "true or false"
    if typing.get_origin(base) is Literal:
        choices = ", ".join(repr(c) for c in typing.get_args(base))
        return f"one of {choices}" + (" (case-insensitive)" if meta.get("case") else "")
    if typing.get_origin(base) is dict:
        return "a mapping with string keys"
    if typing.get_origin(base) is list:
        return "a list of strings"
    if base is str:
        return "a string"
    what = "an integer" if base is int else "a finite number"
    if "ge" in meta and "le" in meta:
        return f"{what} in [{meta['ge']}, {meta['le']}]"
    bounds = [f"{op} {meta[key]}" for key, op in (("ge", ">="), ("gt", ">"), ("le", "<=")) if key in meta]
    return " ".join([what, *bounds])

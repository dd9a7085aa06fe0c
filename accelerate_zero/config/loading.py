"""Raw DeepSpeed config (dict, .json, .yaml/.yml, ZeroConfig) -> validated `ZeroConfig`.

This module owns the keys and the values: reading files (duplicate keys rejected, as DeepSpeed does), unknown keys
(listed sorted, with the closest valid key), aliases (`prefetch_bucket_size` -> `stage3_prefetch_bucket_size`,
block `bfloat16` -> `bf16`), DeepSpeed's deprecated keys (migrated with a `FutureWarning`) and the per-field
coercion every block runs in `__post_init__` (`normalize_fields`: "5e8" and 5e8 -> 500000000, "warn" -> "WARN").
Rules between values live in `config/resolve.py`. Every problem is collected and raised as one `ZeroConfigError`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import numbers
import os
import re
import sys
import types
import typing
import warnings
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from accelerate_zero.config.resolve import static_problems
from accelerate_zero.config.schema import ZeroConfig, ZeroConfigError, is_auto, join_path


_ZERO_SHORT_NAMES = (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
)

ALIASES: dict[str, dict[str, str]] = {
    "": {"bfloat16": "bf16"},
    "zero_optimization": {name: f"stage3_{name}" for name in _ZERO_SHORT_NAMES},
    "bf16": {"check_overflow": "check_grad_overflow"},
    "aio": {"thread_count": "intra_op_parallelism"},
}
"""Block path -> {accepted alias: attribute name}."""

UNSUPPORTED_DEEPSPEED_KEYS = frozenset(
    "activation_checkpointing amp autotuning comms_logger compile compression_training csv_monitor "
    "curriculum_learning data_efficiency disable_allgather dump_state eigenvalue elasticity flops_profiler "
    "gradient_allreduce_op graph_harvesting hybrid_engine log_level managed_gradient_accumulation nebula "
    "pipeline progressive_layer_drop quantize_training seq_parallel_communication_data_type sparse_attention "
    "sparse_gradients tensor_parallel tensorboard timers torch_autocast wandb weight_quantization "
    "checkpoint.checkpoint_serialization checkpoint.writer optimizer.legacy_fusion".split()
)
"""Key paths DeepSpeed knows that accelerate_zero does not implement (reported as unknown, with that reason)."""


def load_config(source: ZeroConfig | Mapping[str, Any] | str | os.PathLike[str]) -> ZeroConfig:
    """Implements `ZeroConfig.from_any` (see there)."""
    if isinstance(source, ZeroConfig):
        return copy.deepcopy(source)
    raw = _read_file(Path(source)) if isinstance(source, str | os.PathLike) else source
    if not isinstance(raw, Mapping):
        raise ZeroConfigError([f"a ZeRO config must be a mapping of keys to values, got {type(raw).__name__}"])
    problems: list[str] = []
    config = _build(ZeroConfig, _normalize_top(raw, problems), "", problems)
    if config is not None:
        problems.extend(static_problems(config))
    if problems or config is None:
        unknown = sorted(p for p in problems if p.startswith("unknown key"))
        raise ZeroConfigError(unknown + [p for p in problems if not p.startswith("unknown key")])
    return config


def auto_keys(config: ZeroConfig) -> list[str]:
    """Implements `ZeroConfig.auto_keys`."""
    return _auto_paths(config.to_dict(), "")


def fill_auto(config: ZeroConfig, values: Mapping[str, Any]) -> ZeroConfig:
    """Implements `ZeroConfig.fill_auto` (see there)."""
    raw = config.to_dict()
    for dotted, value in values.items():
        *parents, leaf = dotted.split(".")
        node: Any = raw
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
        if isinstance(node, dict) and is_auto(node.get(leaf)):
            node[leaf] = value
    return load_config(raw)


def _auto_paths(node: Any, prefix: str) -> list[str]:
    if isinstance(node, dict):
        return [path for key, value in node.items() for path in _auto_paths(value, join_path(prefix, key))]
    return [prefix] if is_auto(node) else []


# ---- files -------------------------------------------------------------------------------------------------------


def _read_file(path: Path) -> Any:
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ZeroConfigError([f"config file '{path}' must end in .json, .yaml or .yml (got {suffix!r})"])
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ZeroConfigError([f"cannot read config file '{path}': {error.strerror or error}"]) from None
    except UnicodeDecodeError as error:
        raise ZeroConfigError(
            [f"config file '{path}' is not UTF-8 text (byte {error.start}: {error.reason}): save it as UTF-8"]
        ) from None
    data, duplicates = _parse_json(text, path) if suffix == ".json" else _parse_yaml(text, path)
    if duplicates:
        raise ZeroConfigError(
            [
                f"duplicate key {key} in '{path}': keep only one (DeepSpeed rejects duplicate keys too)"
                for key in duplicates
            ]
        )
    return data


def _parse_json(text: str, path: Path) -> tuple[Any, list[str]]:
    duplicates: list[str] = []

    def record_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                duplicates.append(repr(key))
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=record_duplicates), duplicates
    except json.JSONDecodeError as error:
        raise ZeroConfigError([f"'{path}' is not valid JSON: {error}"]) from None


class _YamlLoader(yaml.SafeLoader):
    """A SafeLoader that records duplicate mapping keys (PyYAML silently keeps the last one)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[str] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key_node.tag != "tag:yaml.org,2002:merge" and isinstance(key, Hashable):
                if key in seen:
                    self.duplicates.append(f"{key!r} (line {key_node.start_mark.line + 1})")
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(text: str, path: Path) -> tuple[Any, list[str]]:
    loader = _YamlLoader(text)
    try:
        return loader.get_single_data(), loader.duplicates
    except yaml.YAMLError as error:
        raise ZeroConfigError([f"'{path}' is not valid YAML: {' '.join(str(error).split())}"]) from None
    finally:
        loader.dispose()


# ---- keys --------------------------------------------------------------------------------------------------------


def _normalize_top(raw: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """Top-level aliases, the old boolean `zero_optimization` and the deprecated keys inside it."""
    raw = _rename_aliases(raw, "", problems)
    zero = raw.get("zero_optimization")
    if isinstance(zero, bool):
        _warn_deprecated(
            f'"zero_optimization": {json.dumps(zero)} is DeepSpeed\'s deprecated format: '
            f'write "zero_optimization": {{"stage": {int(zero)}}}'
        )
        raw["zero_optimization"] = {"stage": int(zero)}
    elif isinstance(zero, Mapping):
        raw["zero_optimization"] = _migrate_deprecated(_rename_aliases(zero, "zero_optimization", problems), problems)
    return raw


def _rename_aliases(raw: Mapping[str, Any], path: str, problems: list[str]) -> dict[str, Any]:
    aliases = ALIASES.get(path, {})
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = aliases.get(key, key) if isinstance(key, str) else key
        if name != key and name in raw:
            problems.append(
                f"{join_path(path, key)} and {join_path(path, name)} are the same setting: keep only '{name}'"
            )
            continue
        out[name] = value
    return out


_OLD_GATHER_KEY = "stage3_gather_fp16_weights_on_model_save"
_DEPRECATED_ZERO_KEYS = {
    _OLD_GATHER_KEY: "stage3_gather_16bit_weights_on_model_save",
    "cpu_offload": "offload_optimizer",  # true -> {"device": "cpu"}
    "cpu_offload_param": "offload_param",  # true -> {"device": "cpu"}
}


def _migrate_deprecated(zero: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """DeepSpeed's deprecated `zero_optimization` keys -> their replacements (as `_process_deprecated_field`)."""
    for old, new in _DEPRECATED_ZERO_KEYS.items():
        if old not in zero:
            continue
        value = zero.pop(old)
        _warn_deprecated(f"zero_optimization.{old} is deprecated: use zero_optimization.{new} instead")
        if new in zero:
            problems.append(
                f"zero_optimization.{old} (deprecated) and zero_optimization.{new} are both set: keep only '{new}'"
            )
        elif old == _OLD_GATHER_KEY:
            zero[new] = value
        elif not isinstance(value, bool | None):
            problems.append(f"zero_optimization.{old}={value!r}: expected true or false")
        elif value:
            zero[new] = {"device": "cpu"}
    if "cpu_offload_use_pin_memory" in zero:
        _migrate_pin_memory(zero, zero.pop("cpu_offload_use_pin_memory"))
    return zero


def _migrate_pin_memory(zero: dict[str, Any], pin: Any) -> None:
    """`cpu_offload_use_pin_memory` -> `pin_memory` of each offload block that does not set it."""
    _warn_deprecated(
        "zero_optimization.cpu_offload_use_pin_memory is deprecated: "
        "set pin_memory in zero_optimization.offload_optimizer / offload_param instead"
    )
    for block in ("offload_optimizer", "offload_param"):
        if pin is not None and isinstance(zero.get(block), Mapping) and "pin_memory" not in zero[block]:
            zero[block] = {**zero[block], "pin_memory": pin}


def _warn_deprecated(message: str) -> None:
    """A FutureWarning attributed to the first caller outside `accelerate_zero.config` (the user's line)."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("accelerate_zero.config"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, FutureWarning, stacklevel=level)


def _build(cls: type, raw: Any, path: str, problems: list[str]) -> Any:
    """`cls(**raw)`, nested blocks built first; bad keys are reported and left out, so the block that is returned
    holds every valid value (rules between values can still run on it). None if `raw` cannot make a block."""
    if not isinstance(raw, Mapping):
        problems.append(f"{path}={raw!r}: expected a mapping of keys to values")
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in _rename_aliases(raw, path, problems).items():
        if key not in fields:
            problems.append(_unknown_key(path, key, fields))
            continue
        value = _build_value(cls, fields[key], value, join_path(path, key), problems)
        if value is not _BAD:
            kwargs[key] = value
    missing = [name for name, f in fields.items() if name not in kwargs and _is_required(f)]
    for name in missing:
        problems.append(f"{join_path(path, name)} is missing: {_REQUIRED_HINTS.get(join_path(path, name), 'add it')}")
    try:
        return None if missing else cls(**kwargs)
    except ZeroConfigError as error:  # not expected: every value was checked by _build_value
        problems.extend(error.problems)
        return None


def _build_value(cls: type, f: dataclasses.Field[Any], value: Any, path: str, problems: list[str]) -> Any:
    """The validated value of one key (a built block for a nested block), or _BAD after appending its problem."""
    hint = _type_hints(cls)[f.name]
    block, optional = _split_optional(hint)
    if _is_block_type(block) and not (value is None and optional):
        built = _build(block, value, path, problems)
        return _BAD if built is None else built
    value, problem = coerce_value(path, value, hint, f.metadata)
    if problem is not None:
        problems.append(problem)
        return _BAD
    return value


_REQUIRED_HINTS = {
    "optimizer.type": 'name the optimizer, e.g. "type": "AdamW"',
    "scheduler.type": 'name the LR scheduler, e.g. "type": "WarmupLR"',
}


def _is_required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _unknown_key(path: str, key: Any, fields: Mapping[str, Any]) -> str:
    full = join_path(path, str(key))
    if full in UNSUPPORTED_DEEPSPEED_KEYS:
        return f"unknown key '{full}': it is a DeepSpeed option accelerate_zero does not implement; remove it"
    valid = sorted([*fields, *ALIASES.get(path, {})])
    close = difflib.get_close_matches(str(key), valid, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown key '{full}'{hint}: remove it or fix its spelling"


# ---- values ------------------------------------------------------------------------------------------------------

_BAD = object()
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def normalize_fields(block: Any) -> list[str]:
    """Validates and normalizes every field of a config block in place; returns one problem per bad field."""
    problems: list[str] = []
    hints = _type_hints(type(block))
    for f in dataclasses.fields(block):
        path = join_path(block._PATH, f.name)
        value, problem = coerce_value(path, getattr(block, f.name), hints[f.name], f.metadata)
        if problem is not None:
            problems.append(problem)
        else:
            setattr(block, f.name, value)
    return problems


_TYPE_HINTS: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    if cls not in _TYPE_HINTS:
        _TYPE_HINTS[cls] = typing.get_type_hints(cls)
    return _TYPE_HINTS[cls]


def _is_block_type(hint: Any) -> typing.TypeGuard[type]:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _split_optional(hint: Any) -> tuple[Any, bool]:
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
    base, optional = _split_optional(hint)
    if meta.get("inf_is_none") and isinstance(value, float) and value == math.inf:
        return None, None
    if value is None and optional:
        return None, None
    if _is_block_type(base):
        if isinstance(value, base):
            return value, None
        return value, f"{path}={value!r}: expected a {base.__name__} (build configs with ZeroConfig.from_any)"
    if is_auto(value):
        return value, None
    converted = _convert(value, base, meta)
    if converted is _BAD or not _in_range(converted, meta):
        return value, f"{path}={value!r}: expected {_describe(base, meta)}" + (" or null" if optional else "")
    return converted, None


def _convert(value: Any, base: Any, meta: Mapping[str, Any]) -> Any:
    if base is bool:
        return value if isinstance(value, bool) else _BAD
    if base is int or base is float:
        number = parse_number(value)
        if number is None or not math.isfinite(number):
            return _BAD
        if base is float:
            return float(number)
        return int(number) if float(number).is_integer() else _BAD
    if base is str:
        return os.fspath(value) if isinstance(value, str | Path) else _BAD
    if typing.get_origin(base) is Literal:
        if isinstance(value, str) and meta.get("case"):
            value = value.upper() if meta["case"] == "upper" else value.lower()
        return value if isinstance(value, str) and value in typing.get_args(base) else _BAD
    if typing.get_origin(base) is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            return _BAD
        return {k: _numeric(v) if meta.get("numeric_strings") else copy.deepcopy(v) for k, v in value.items()}
    if typing.get_origin(base) is list:
        items = [value] if isinstance(value, str) else value
        ok = isinstance(items, list | tuple) and all(isinstance(v, str) for v in items)
        return list(items) if ok else _BAD
    return _BAD


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

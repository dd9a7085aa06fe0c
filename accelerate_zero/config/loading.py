"""Raw DeepSpeed config (dict, .json, .yaml/.yml, ZeroConfig) -> validated `ZeroConfig`.

This module owns the keys and the values: reading files (duplicate keys rejected, as DeepSpeed does), unknown keys
(listed sorted, with the closest valid key), aliases (`prefetch_bucket_size` -> `stage3_prefetch_bucket_size`,
block `bfloat16` -> `bf16`), DeepSpeed's deprecated keys (migrated with a `FutureWarning`) and the per-field
coercion every block runs in `__post_init__` (config/fields.py: "5e8" and 5e8 -> 500000000, "warn" -> "WARN").
Rules between values live in `config/schema.py` (load time) and `config/resolve.py` (run time). Every problem is collected and raised as one `ZeroConfigError`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
import sys
import warnings
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from accelerate_zero.config.blocks import Block
from accelerate_zero.config.checkpoint_writer import WRITER_PATH, writer_problems
from accelerate_zero.config.fields import INVALID, coerce_value, is_block_type, split_optional, type_hints
from accelerate_zero.config.values import ZeroConfigError, is_auto, join_path


ConfigT = TypeVar("ConfigT", bound=Block)


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
    "amp autotuning comms_logger compression_training csv_monitor "
    "curriculum_learning data_efficiency disable_allgather dump_state eigenvalue elasticity flops_profiler "
    "gradient_allreduce_op graph_harvesting hybrid_engine log_level managed_gradient_accumulation nebula "
    "pipeline progressive_layer_drop quantize_training seq_parallel_communication_data_type sparse_attention "
    "sparse_gradients tensor_parallel tensorboard timers torch_autocast wandb weight_quantization "
    "checkpoint.checkpoint_serialization optimizer.legacy_fusion".split()
)
"""Key paths DeepSpeed knows that accelerate_zero does not implement (reported as unknown, with that reason)."""


def load_config(
    cls: type[ConfigT],
    source: ConfigT | Mapping[str, Any] | str | os.PathLike[str],
    rules: Callable[[ConfigT], list[str]],
) -> ConfigT:
    """Implements `ZeroConfig.from_any` (see there): `cls` built from `source`, then checked by `rules` (the rules
    between values, which run on a config whose every value is valid)."""
    if isinstance(source, cls):
        return copy.deepcopy(source)
    raw = _read_file(Path(source)) if isinstance(source, str | os.PathLike) else source
    if not isinstance(raw, Mapping):
        raise ZeroConfigError([f"a ZeRO config must be a mapping of keys to values, got {type(raw).__name__}"])
    problems: list[str] = []
    config = _build(cls, _normalize_top(raw, problems), "", problems)
    if config is not None:
        problems.extend(rules(config))
    if problems or config is None:
        unknown = sorted(p for p in problems if p.startswith("unknown key"))
        raise ZeroConfigError(unknown + [p for p in problems if not p.startswith("unknown key")])
    return config


def auto_keys(config: Block) -> list[str]:
    """Implements `ZeroConfig.auto_keys`."""
    return _auto_paths(config.to_dict(), "")


def filled_autos(config: Block, values: Mapping[str, Any]) -> dict[str, Any]:
    """Implements `ZeroConfig.fill_auto` (see there): the config as a dict with the values filled in."""
    raw = config.to_dict()
    for dotted, value in values.items():
        *parents, leaf = dotted.split(".")
        node: Any = raw
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
        if isinstance(node, dict) and is_auto(node.get(leaf)):
            node[leaf] = value
    return raw


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
        if join_path(path, str(key)) == WRITER_PATH:
            # [Note: DeepSpeed's checkpoint writer] in config/checkpoint_writer.py: its keys are checked there.
            problems.extend(writer_problems(value))
        if key not in fields:
            problems.append(_unknown_key(path, key, fields))
            continue
        value = _build_value(cls, fields[key], value, join_path(path, key), problems)
        if value is not INVALID:
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
    """The validated value of one key (a built block for a nested block), or INVALID after appending its problem."""
    hint = type_hints(cls)[f.name]
    block, optional = split_optional(hint)
    if is_block_type(block) and not (value is None and optional):
        built = _build(block, value, path, problems)
        return INVALID if built is None else built
    value, problem = coerce_value(path, value, hint, f.metadata)
    if problem is not None:
        problems.append(problem)
        return INVALID
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

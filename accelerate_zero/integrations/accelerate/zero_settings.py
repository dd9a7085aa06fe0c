"""`ZeroSettings`: everything that configures ZeRO, gathered from an accelerate config and `accelerate launch` flags.

`settings_from_accelerate` reads the `deepspeed_config` block of an accelerate config as accelerate's
`DeepSpeedPlugin` would (plugin fields, a `deepspeed_config_file`, `mixed_precision`), plus what accelerate_zero
adds on purpose: DeepSpeed `zero_optimization` keys written directly in the block go into `zero_optimization`, and
DeepSpeed's top-level settings (`TOP_LEVEL_KEYS`: TRL's ALST config writes
`seq_parallel_communication_data_type` there) into the DeepSpeed config's top level (accelerate ignores both); any
other unknown key is an error. Nothing is built here: `deepspeed_build.py` turns
the settings into the DeepSpeed config and reports the problems gathered here together with its own.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from accelerate_zero.config import ZeroConfig, ZeroConfigError
from accelerate_zero.config.deepspeed_keys import TOP_LEVEL, Treatment
from accelerate_zero.config.fields import is_block_type, split_optional, type_hints
from accelerate_zero.config.loading import ALIASES
from accelerate_zero.config.schema import ZeroOptimizationConfig
from accelerate_zero.integrations.accelerate.plugin_fields import OFFLOAD_BLOCKS, PLUGIN_FIELDS, coerce_field


LAUNCHER_KEYS = (
    "deepspeed_config_file",
    "deepspeed_multinode_launcher",
    "deepspeed_hostfile",
    "deepspeed_exclusion_filter",
    "deepspeed_inclusion_filter",
    "deepspeed_moe_layer_cls_names",
)
"""The other keys accelerate writes in a `deepspeed_config` block (not plugin fields)."""

_DEPRECATED_ZERO_KEYS = (
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "stage3_gather_fp16_weights_on_model_save",
)
ZERO_KEYS = frozenset(
    [f.name for f in dataclasses.fields(ZeroOptimizationConfig)]
    + list(ALIASES["zero_optimization"])
    + list(_DEPRECATED_ZERO_KEYS)
)
"""DeepSpeed `zero_optimization` keys (names, aliases, deprecated names) accepted in a `deepspeed_config` block."""

TOP_LEVEL_KEYS = frozenset(
    f.name
    for f in dataclasses.fields(ZeroConfig)
    if f.name in TOP_LEVEL
    and TOP_LEVEL[f.name].treatment is Treatment.BUILT
    and not is_block_type(split_optional(type_hints(ZeroConfig)[f.name])[0])
    and f.name not in ("gradient_accumulation_steps", "gradient_clipping")  # plugin fields of the same name
)
"""DeepSpeed's top-level scalar settings accepted in a `deepspeed_config` block (they go to the config's top level)."""

# zero_optimization keys that say the same as a plugin field: written in the block, they set that field.
_ZERO_KEY_FIELDS = {
    "stage": "zero_stage",
    "stage3_gather_16bit_weights_on_model_save": "zero3_save_16bit_model",
    "gather_16bit_weights_on_model_save": "zero3_save_16bit_model",
    "stage3_gather_fp16_weights_on_model_save": "zero3_save_16bit_model",
}


@dataclass(kw_only=True)
class ZeroSettings:
    """Everything that configures ZeRO, gathered before the DeepSpeed config is built."""

    fields: dict[str, Any] = field(default_factory=dict)
    """Plugin field -> value set explicitly (accelerate config, flag, `ZeroPlugin` argument); absent: not set."""
    sources: dict[str, str] = field(default_factory=dict)
    """Plugin field -> where it was set, to name it in messages ("--zero_stage", "deepspeed_config.zero_stage")."""
    env_fields: dict[str, Any] = field(default_factory=dict)
    """Plugin field -> value read from the environment: fills "auto" values only, never contradicts."""
    config: dict[str, Any] | None = None
    """A DeepSpeed config to start from (raw, as written); None generates one from the fields."""
    config_label: str = "the DeepSpeed config"
    """How to name `config` in messages, e.g. "deepspeed_config_file ds.json"."""
    fields_override_config: bool = False
    """True when `config` is a launcher's output (`ACCELERATE_ZERO_CONFIG`): explicit fields replace its values."""
    zero_optimization: dict[str, Any] = field(default_factory=dict)
    """DeepSpeed `zero_optimization` keys written in the accelerate `deepspeed_config` block."""
    top_level: dict[str, Any] = field(default_factory=dict)
    """DeepSpeed top-level settings (`TOP_LEVEL_KEYS`) written in the accelerate `deepspeed_config` block."""
    mixed_precision: str | None = None
    """"no", "fp16" or "bf16" (accelerate's setting); None leaves `fp16`/`bf16` as the config has them."""
    mixed_precision_set: bool = False
    """True when a flag or the accelerate config chose `mixed_precision` (else "no" is accelerate's default)."""
    file_owned: list[str] = field(default_factory=list)
    """accelerate config keys that are an error next to a DeepSpeed config file (accelerate's
    ACCELERATE_CONFIG_DS_FIELDS: the `deepspeed_config` block's keys, and `mixed_precision` when the config sets it)."""
    problems: list[str] = field(default_factory=list)
    """Problems found while gathering (unknown keys, bad values, left out); reported with the build's."""


def read_deepspeed_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A DeepSpeed config file (.json, .yaml, .yml) as written, after `ZeroConfig.from_any` accepted it.

    Raises:
        ZeroConfigError: the file is missing, unreadable or invalid (every problem listed).
    """
    ZeroConfig.from_any(path)  # reports a missing file, syntax errors, duplicate and unknown keys, bad values
    text = Path(path).read_text(encoding="utf-8")
    raw = json.loads(text) if Path(path).suffix.lower() == ".json" else yaml.safe_load(text)
    return raw if isinstance(raw, dict) else {}


# ---- the accelerate deepspeed_config block -------------------------------------------------------------------------


def settings_from_accelerate(
    block: Mapping[str, Any],
    flags: Mapping[str, Any],
    *,
    config_mixed_precision: str | None = None,
    config_is_deepspeed: bool = True,
    source: str = "the accelerate config",
) -> ZeroSettings:
    """The `deepspeed_config` block of an accelerate config and `accelerate launch` flags -> `ZeroSettings`.

    Args:
        block: the `deepspeed_config:` mapping of the accelerate config ({} when there is none).
        flags: `accelerate launch` flag values by name (`vars(args)`); None means the flag was not given.
        config_mixed_precision: the accelerate config's top-level `mixed_precision` (None: not set).
        config_is_deepspeed: the accelerate config says `distributed_type: DEEPSPEED`; then its `mixed_precision`
            counts as a DeepSpeed setting (an error next to a `deepspeed_config_file`, as in accelerate).
        source: how to name the accelerate config file in messages.

    Returns:
        The settings; unknown keys, settings written twice and bad values are in `problems` (and left out), so
        `build_deepspeed_config` reports them together with its own.

    Raises:
        ZeroConfigError: the `deepspeed_config_file` cannot be read or is invalid (with every other problem).
    """
    problems: list[str] = []
    values, sources, zero, top = _split_block(block, source, problems)
    for name in PLUGIN_FIELDS:
        if flags.get(name) is not None:
            values[name], sources[name] = flags[name], f"--{name}"
    config_file = flags.get("deepspeed_config_file") or block.get("deepspeed_config_file")
    settings = ZeroSettings(zero_optimization=zero, top_level=top, file_owned=[str(key) for key in block])
    mixed_precision = flags.get("mixed_precision")
    if mixed_precision is None and config_mixed_precision is not None:
        mixed_precision = config_mixed_precision
        if config_is_deepspeed:
            settings.file_owned.append("mixed_precision")
    settings.mixed_precision = str(mixed_precision or "no").lower()
    settings.mixed_precision_set = mixed_precision is not None
    settings.sources = sources
    for name, value in values.items():
        typed, problem = coerce_field(name, value, sources[name])
        if problem is None:
            settings.fields[name] = typed
        else:
            problems.append(problem)
    settings.problems = problems
    if config_file is not None and str(config_file).lower() != "none":
        settings.config_label = f"deepspeed_config_file {config_file}"
        try:
            settings.config = read_deepspeed_config(config_file)
        except ZeroConfigError as error:  # nothing sensible can be built without it
            raise ZeroConfigError(problems + [f"{settings.config_label}: {p}" for p in error.problems]) from None
    return settings


def _split_block(
    block: Mapping[str, Any], source: str, problems: list[str]
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any], dict[str, Any]]:
    """The block's plugin fields (with their sources), its DeepSpeed `zero_optimization` keys and its DeepSpeed
    top-level settings; unknown keys and settings written twice are appended to `problems`."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    zero: dict[str, Any] = {}
    top: dict[str, Any] = {}
    known = sorted({*PLUGIN_FIELDS, *LAUNCHER_KEYS, *ZERO_KEYS, *TOP_LEVEL_KEYS})
    for key, value in block.items():
        where = f"deepspeed_config.{key} in {source}"
        if key in PLUGIN_FIELDS:
            values[key], sources[key] = value, where
        elif key in ZERO_KEYS:
            zero[key] = value
        elif key in TOP_LEVEL_KEYS:
            top[key] = value
        elif key not in LAUNCHER_KEYS:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(
                f"unknown key 'deepspeed_config.{key}' in {source}{hint}: it is neither an accelerate DeepSpeed "
                "setting nor a DeepSpeed zero_optimization or top-level key; remove it or fix its spelling"
            )
    for key, name in _ZERO_KEY_FIELDS.items():
        if key in zero:
            _take_zero_key(values, sources, name, key, zero.pop(key), source, problems)
    for key, block_name in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if isinstance(zero.get(key), bool):  # DeepSpeed's deprecated spelling of device "cpu"
            device = "cpu" if zero.pop(key) else "none"
            _take_zero_key(values, sources, f"{block_name}_device", key, device, source, problems)
    for block_name in OFFLOAD_BLOCKS:
        offload = zero.get(block_name)
        if not isinstance(offload, Mapping):
            continue
        rest = dict(offload)
        for key in ("device", "nvme_path"):
            if key in rest:
                name = f"{block_name}_{key}"
                _take_zero_key(values, sources, name, f"{block_name}.{key}", rest.pop(key), source, problems)
        zero[block_name] = rest
    return values, sources, zero, top


def _take_zero_key(
    values: dict[str, Any],
    sources: dict[str, str],
    name: str,
    key: str,
    value: Any,
    source: str,
    problems: list[str],
) -> None:
    if name in values:
        problems.append(
            f"deepspeed_config.{key} and {sources[name]} are the same setting: keep only '{name}' in {source}"
        )
        return
    values[name], sources[name] = value, f"deepspeed_config.{key} in {source}"

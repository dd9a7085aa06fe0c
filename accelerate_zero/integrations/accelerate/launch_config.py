"""Accelerate config (`deepspeed_config` block, `deepspeed_config_file`) + flags -> DeepSpeed JSON + rank environment.

Pure: starts nothing, does not import accelerate, reads only the DeepSpeed config file it is given. Both
`accelerate-zero launch` (`launcher.py`) and `ZeroPlugin` (`plugin.py`) build their config here, with the rules of
accelerate 1.15's `DeepSpeedPlugin` (`accelerate/utils/dataclasses.py`: `__post_init__`, `set_mixed_precision`,
`_deepspeed_config_checks`):

* without a DeepSpeed config file the plugin fields generate `{"train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": GA, "gradient_clipping": CLIP,
  "zero_optimization": {"stage", "offload_optimizer", "offload_param", "stage3_gather_16bit_weights_on_model_save"}}`;
* with one (`deepspeed_config_file`) the plugin fields only fill its "auto" values, a missing
  `gradient_accumulation_steps` becomes 1, `zero_optimization` is required, and accelerate config keys the file
  owns are accelerate's "When using `deepspeed_config_file`, ..." error;
* `mixed_precision` fp16/bf16 adds or fills `fp16.enabled` / `bf16.enabled` (`DeepSpeedPlugin.set_mixed_precision`).

Differences from accelerate, on purpose:

* DeepSpeed `zero_optimization` keys written directly in the `deepspeed_config` block (overlap_comm,
  reduce_bucket_size, ...) go into `zero_optimization` (accelerate ignores them); any other unknown key is an error;
* NVMe paths reach the ranks (accelerate 1.15 never exports them) and an NVMe device without a path is an error;
* `gradient_clipping: 0.0` is kept (accelerate drops a falsy value, and DeepSpeed 0.19's default then clips at 1.0);
* a flag or `ZeroPlugin` argument that contradicts a non-"auto" value of a DeepSpeed config file is an error
  (accelerate silently keeps the file's value);
* `steps_per_print` is not added (accelerate sets it to inf to silence DeepSpeed; accelerate_zero never prints).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from accelerate_zero.config import ZeroConfig, ZeroConfigError, resolve_config
from accelerate_zero.config.fields import parse_number
from accelerate_zero.config.loading import ALIASES
from accelerate_zero.config.schema import ZeroOptimizationConfig, is_auto


CONFIG_ENV = "ACCELERATE_ZERO_CONFIG"
"""The DeepSpeed JSON config every rank reads (a JSON string, "auto" values kept)."""
ENV_PREFIX = "ACCELERATE_ZERO_"
"""`ACCELERATE_ZERO_<FIELD>` holds the value of each `ZeroPlugin` field (e.g. ACCELERATE_ZERO_ZERO_STAGE)."""
MOE_ENV = "ACCELERATE_ZERO_MOE_LAYER_CLS_NAMES"
"""Comma-separated MoE layer class names (accelerate's `deepspeed_moe_layer_cls_names`), for stage 3 leaf modules."""

FIELD_DS_KEYS: dict[str, str | None] = {
    "zero_stage": "zero_optimization.stage",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "zero3_init_flag": None,  # not a DeepSpeed key: build the model sharded (stage 3 only)
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}
"""Plugin field (accelerate's `DeepSpeedPlugin` name) -> the DeepSpeed key it sets (accelerate's mapping)."""
PLUGIN_FIELDS = tuple(FIELD_DS_KEYS)

_DEFAULTS: dict[str, Any] = {
    "zero_stage": 2,
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "offload_optimizer_device": "none",
    "offload_param_device": "none",
    "zero3_save_16bit_model": False,
}
"""accelerate's `DeepSpeedPlugin` defaults; the NVMe paths default to None, `zero3_init_flag` to `stage == 3`."""

LAUNCHER_KEYS = (
    "deepspeed_config_file",
    "deepspeed_multinode_launcher",
    "deepspeed_hostfile",
    "deepspeed_exclusion_filter",
    "deepspeed_inclusion_filter",
    "deepspeed_moe_layer_cls_names",
)
"""The other keys accelerate writes in a `deepspeed_config` block (not plugin fields)."""

FILE_OWNED_KEYS = (
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_param_nvme_path",
    "offload_optimizer_nvme_path",
    "zero3_save_16bit_model",
    "mixed_precision",
)
"""accelerate config keys a `deepspeed_config_file` owns (accelerate's `_deepspeed_config_checks` list, in order)."""

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

# zero_optimization keys that say the same as a plugin field: written in the block, they set that field.
_ZERO_KEY_FIELDS = {
    "stage": "zero_stage",
    "stage3_gather_16bit_weights_on_model_save": "zero3_save_16bit_model",
    "gather_16bit_weights_on_model_save": "zero3_save_16bit_model",
    "stage3_gather_fp16_weights_on_model_save": "zero3_save_16bit_model",
}
_OFFLOAD_BLOCKS = ("offload_optimizer", "offload_param")


def env_name(field_name: str) -> str:
    """The environment variable of a plugin field: `zero_stage` -> `ACCELERATE_ZERO_ZERO_STAGE`."""
    return ENV_PREFIX + field_name.upper()


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
    mixed_precision: str | None = None
    """"no", "fp16" or "bf16" (accelerate's setting); None leaves `fp16`/`bf16` as the config has them."""
    file_owned: list[str] = field(default_factory=list)
    """accelerate config keys that are an error next to a DeepSpeed config file (accelerate's
    ACCELERATE_CONFIG_DS_FIELDS: the `deepspeed_config` block's keys, and `mixed_precision` when the config sets it)."""
    problems: list[str] = field(default_factory=list)
    """Problems found while gathering (unknown keys, bad values, left out); reported with the build's."""


class BuiltConfig(NamedTuple):
    """The DeepSpeed config built from `ZeroSettings`, validated."""

    deepspeed_config: dict[str, Any]
    """DeepSpeed JSON form; "auto" values kept (the integration fills them at prepare time)."""
    zero_config: ZeroConfig
    """The same, validated by `ZeroConfig.from_any` (not resolved)."""
    fields: dict[str, Any]
    """Plugin field -> the value the config gives it (None or "auto" fields left out), incl. `zero3_init_flag`."""


# ---- field values ------------------------------------------------------------------------------------------------

_DEVICES = ("none", "cpu", "nvme")
_TRUE = ("1", "true", "yes", "y", "on", "t")
_FALSE = ("0", "false", "no", "n", "off", "f")


def coerce_field(name: str, value: Any, where: str) -> tuple[Any, str | None]:
    """One plugin field value (from YAML, a flag string or the environment) -> (typed value, problem or None)."""
    if name == "zero_stage":
        number = parse_number(value)
        if isinstance(number, int | float) and float(number).is_integer() and 0 <= number <= 3:
            return int(number), None
        return value, f"{where}={value!r}: expected a ZeRO stage 0, 1, 2 or 3"
    if name == "gradient_clipping" or name == "gradient_accumulation_steps":
        if is_auto(value):
            return value, None
        number = parse_number(value)
        if name == "gradient_clipping" and number is not None and number >= 0:
            return float(number), None
        if name == "gradient_accumulation_steps" and number is not None and float(number).is_integer() and number >= 1:
            return int(number), None
        expected = "a number >= 0" if name == "gradient_clipping" else "an integer >= 1"
        return value, f'{where}={value!r}: expected {expected} or "auto"'
    if name.endswith("_device"):
        if isinstance(value, str) and value.lower() in _DEVICES:
            return value.lower(), None
        return value, f"{where}={value!r}: expected one of 'none', 'cpu', 'nvme'"
    if name.endswith("_nvme_path"):
        if isinstance(value, str | os.PathLike):
            path = os.fspath(value)
            return (None if path.lower() in ("", "none") else path), None  # accelerate writes "none" for unset
        return value, f"{where}={value!r}: expected a folder path"
    if isinstance(value, bool):
        return value, None
    if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE, None
    return value, f"{where}={value!r}: expected true or false"


def coerce_fields(values: Mapping[str, Any], sources: Mapping[str, str]) -> dict[str, Any]:
    """Coerces every value; raises one `ZeroConfigError` listing every bad one."""
    out, problems = {}, []
    for name, value in values.items():
        out[name], problem = coerce_field(name, value, sources.get(name, name))
        if problem is not None:
            problems.append(problem)
    if problems:
        raise ZeroConfigError(problems)
    return out


def read_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The plugin fields and the DeepSpeed config `accelerate-zero launch` exported (None when it did not).

    Raises:
        ZeroConfigError: naming each variable whose value is bad.
    """
    raw = {name: environ[env_name(name)] for name in PLUGIN_FIELDS if env_name(name) in environ}
    fields = coerce_fields(raw, {name: env_name(name) for name in raw})
    text = environ.get(CONFIG_ENV)
    if text is None:
        return fields, None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ZeroConfigError([f"{CONFIG_ENV} is not a JSON object: {error}"]) from None
    if not isinstance(config, dict):
        raise ZeroConfigError([f"{CONFIG_ENV} is not a JSON object (got {type(config).__name__})"])
    return fields, config


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
    values, sources, zero = _split_block(block, source, problems)
    for name in PLUGIN_FIELDS:
        if flags.get(name) is not None:
            values[name], sources[name] = flags[name], f"--{name}"
    config_file = flags.get("deepspeed_config_file") or block.get("deepspeed_config_file")
    settings = ZeroSettings(zero_optimization=zero, file_owned=[str(key) for key in block])
    mixed_precision = flags.get("mixed_precision")
    if mixed_precision is None and config_mixed_precision is not None:
        mixed_precision = config_mixed_precision
        if config_is_deepspeed:
            settings.file_owned.append("mixed_precision")
    settings.mixed_precision = str(mixed_precision or "no").lower()
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
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """The block's plugin fields (with their sources) and its DeepSpeed `zero_optimization` keys; unknown keys and
    settings written twice are appended to `problems`."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    zero: dict[str, Any] = {}
    known = sorted({*PLUGIN_FIELDS, *LAUNCHER_KEYS, *ZERO_KEYS})
    for key, value in block.items():
        where = f"deepspeed_config.{key} in {source}"
        if key in PLUGIN_FIELDS:
            values[key], sources[key] = value, where
        elif key in ZERO_KEYS:
            zero[key] = value
        elif key not in LAUNCHER_KEYS:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(
                f"unknown key 'deepspeed_config.{key}' in {source}{hint}: it is neither an accelerate DeepSpeed "
                "setting nor a DeepSpeed zero_optimization key; remove it or fix its spelling"
            )
    for key, name in _ZERO_KEY_FIELDS.items():
        if key in zero:
            _take_zero_key(values, sources, name, key, zero.pop(key), source, problems)
    for key, block_name in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if isinstance(zero.get(key), bool):  # DeepSpeed's deprecated spelling of device "cpu"
            device = "cpu" if zero.pop(key) else "none"
            _take_zero_key(values, sources, f"{block_name}_device", key, device, source, problems)
    for block_name in _OFFLOAD_BLOCKS:
        offload = zero.get(block_name)
        if not isinstance(offload, Mapping):
            continue
        rest = dict(offload)
        for key in ("device", "nvme_path"):
            if key in rest:
                name = f"{block_name}_{key}"
                _take_zero_key(values, sources, name, f"{block_name}.{key}", rest.pop(key), source, problems)
        zero[block_name] = rest
    return values, sources, zero


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


# ---- building the DeepSpeed config ---------------------------------------------------------------------------------


def build_deepspeed_config(settings: ZeroSettings) -> BuiltConfig:
    """Builds and validates the DeepSpeed config `settings` describe, as accelerate's `DeepSpeedPlugin` does.

    Raises:
        ZeroConfigError: listing every problem (conflicts with a config file, NVMe without a path, and everything
            `ZeroConfig.from_any` reports), each naming the key.
    """
    problems = list(settings.problems)
    values = {**_DEFAULTS, **settings.env_fields, **settings.fields}
    if settings.config is None:
        config = _generate(values, settings.zero_optimization)
    else:
        config = _from_config(settings, values, problems)
    if settings.mixed_precision is not None:
        apply_mixed_precision(config, settings.mixed_precision, problems)
    problems.extend(_offload_problems(config, settings))
    zero_config = None
    try:
        zero_config = ZeroConfig.from_any(config)
    except ZeroConfigError as error:
        problems.extend(error.problems)
    if problems or zero_config is None:
        raise ZeroConfigError(problems)
    return BuiltConfig(config, zero_config, _fields_of(config, values, settings))


def _generate(values: Mapping[str, Any], zero_keys: Mapping[str, Any]) -> dict[str, Any]:
    """accelerate's generated config (no `deepspeed_config_file`), plus the block's `zero_optimization` keys."""
    zero: dict[str, Any] = {"stage": values["zero_stage"]}
    for block in _OFFLOAD_BLOCKS:
        device = values[f"{block}_device"]
        nvme_path = values.get(f"{block}_nvme_path") if device == "nvme" else None
        extra = zero_keys.get(block, {})  # not a mapping: kept, so ZeroConfig reports it
        zero[block] = {"device": device, "nvme_path": nvme_path, **extra} if isinstance(extra, Mapping) else extra
    zero["stage3_gather_16bit_weights_on_model_save"] = values["zero3_save_16bit_model"]
    zero.update({key: value for key, value in zero_keys.items() if key not in _OFFLOAD_BLOCKS})
    config: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": values["gradient_accumulation_steps"],
    }
    if values["gradient_clipping"] is not None:
        config["gradient_clipping"] = values["gradient_clipping"]
    config["zero_optimization"] = zero
    return config


def _from_config(settings: ZeroSettings, values: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """accelerate's rules for a given DeepSpeed config: plugin values fill its "auto" entries."""
    config = copy.deepcopy(settings.config) or {}
    config.setdefault("gradient_accumulation_steps", 1)
    label = settings.config_label
    if "zero_optimization" not in config:
        problems.append(
            f'{label}: Please specify the ZeRO optimization config in the DeepSpeed config ("zero_optimization").'
        )
    owned = [key for key in FILE_OWNED_KEYS if key in settings.file_owned]
    if owned:
        problems.append(
            f"When using `deepspeed_config_file`, the following accelerate config variables will be ignored: "
            f"{list(FILE_OWNED_KEYS)}. Found: {owned}. Please specify them appropriately in the DeepSpeed config file "
            "and remove them from the accelerate config file."
        )
    zero_keys = sorted(key for key in settings.file_owned if key in ZERO_KEYS)
    if zero_keys:
        problems.append(
            f"deepspeed_config keys {zero_keys} are ignored when using `deepspeed_config_file`: write them in the "
            f"zero_optimization block of {label}"
        )
    for name, path in FIELD_DS_KEYS.items():
        if path is None or values.get(name) is None:
            continue
        if settings.fields_override_config and name in settings.fields:
            _set_path(config, path, values[name])
            continue
        node, key = _find_node(config, path)
        if node is None or key not in node:
            continue  # as accelerate: a value the config does not have is not added
        if is_auto(node[key]):
            node[key] = values[name]
        elif name in settings.fields and not same_value(node[key], values[name]):
            where = settings.sources.get(name, name)
            problems.append(
                f'{where}={values[name]!r} contradicts {path}={node[key]!r} in {label}: set {path} to "auto" '
                f"in the file to use {where}, or drop {where}"
            )
    return config


def apply_mixed_precision(config: dict[str, Any], mixed_precision: str, problems: list[str]) -> None:
    """accelerate's `DeepSpeedPlugin.set_mixed_precision`: adds/fills `fp16.enabled` and `bf16.enabled` in place."""
    if mixed_precision not in ("no", "fp16", "bf16"):
        problems.append(f"mixed_precision={mixed_precision!r}: accelerate_zero supports 'no', 'fp16' and 'bf16'")
        return
    if "bfloat16" in config and "bf16" not in config:  # DeepSpeed's old block name
        config["bf16"] = config.pop("bfloat16")
    if mixed_precision != "no":
        other = "bf16" if mixed_precision == "fp16" else "fp16"
        block = config.get(other)
        if isinstance(block, Mapping) and str(block.get("enabled", "False")).lower() == "true":
            problems.append(
                f"`--mixed_precision` arg cannot be set to `{mixed_precision}` when `{other}` is set in the DeepSpeed "
                f'config file: set {other}.enabled to false or "auto", or change mixed_precision'
            )
            return
    if mixed_precision == "fp16" and "fp16" not in config:
        config["fp16"] = {"enabled": True, "auto_cast": True}
    elif mixed_precision == "bf16" and "bf16" not in config:
        config["bf16"] = {"enabled": True}
    for dtype in ("fp16", "bf16"):
        block = config.setdefault(dtype, {"enabled": False})
        if isinstance(block, dict) and is_auto(block.get("enabled")):
            block["enabled"] = mixed_precision == dtype


def _offload_problems(config: Mapping[str, Any], settings: ZeroSettings) -> list[str]:
    """NVMe without a path, and parameter offload below stage 3, named by the setting the user wrote."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, Mapping):
        return []
    problems = []
    for block in _OFFLOAD_BLOCKS:
        offload = zero.get(block)
        if not isinstance(offload, Mapping) or str(offload.get("device")).lower() != "nvme":
            continue
        if str(offload.get("nvme_path") or "none").lower() == "none":
            where = settings.sources.get(f"{block}_device", f"zero_optimization.{block}.device")
            problems.append(
                f"{where} is 'nvme' but no NVMe folder is set: set {block}_nvme_path in the accelerate config's "
                f"deepspeed_config block (or --{block}_nvme_path), or zero_optimization.{block}.nvme_path in a "
                "DeepSpeed config file, to a folder on a fast local disk"
            )
    stage, param = zero.get("stage"), zero.get("offload_param")
    device = param.get("device") if isinstance(param, Mapping) else None
    if isinstance(stage, int) and stage < 3 and isinstance(device, str) and device.lower() not in ("none", "auto"):
        where = settings.sources.get("offload_param_device", "zero_optimization.offload_param.device")
        problems.append(
            f"{where}={device!r} needs ZeRO stage 3 (got zero_stage {stage}): parameter offload only exists at "
            "stage 3; set zero_stage to 3 or offload_param_device to 'none'"
        )
    return problems


def _fields_of(config: Mapping[str, Any], values: Mapping[str, Any], settings: ZeroSettings) -> dict[str, Any]:
    """The plugin fields as the built config sets them (accelerate back-fills its plugin the same way)."""
    fields: dict[str, Any] = {}
    for name, path in FIELD_DS_KEYS.items():
        node, key = _find_node(config, path) if path is not None else (None, "")
        value = node.get(key) if node is not None else None
        if value is not None and not is_auto(value):
            fields[name] = value
    stage = fields.get("zero_stage")
    init_flag = values.get("zero3_init_flag")
    if init_flag is None:
        init_flag = stage == 3
    elif init_flag and stage != 3:
        where = settings.sources.get("zero3_init_flag", "zero3_init_flag")
        warnings.warn(f"{where}=true only applies to ZeRO stage 3 (got {stage}): setting it to false", stacklevel=3)
        init_flag = False
    fields["zero3_init_flag"] = init_flag
    return fields


def _find_node(config: Mapping[str, Any], path: str) -> tuple[Any, str]:
    *parents, key = path.split(".")
    node: Any = config
    for name in parents:
        node = node.get(name) if isinstance(node, Mapping) else None
    return (node if isinstance(node, dict) else None), key


def _set_path(config: dict[str, Any], path: str, value: Any) -> None:
    *parents, key = path.split(".")
    node = config
    for name in parents:
        if not isinstance(node.get(name), dict):
            node[name] = {}
        node = node[name]
    node[key] = value


def same_value(a: Any, b: Any) -> bool:
    """Equal as DeepSpeed config values: numbers by value ("5e8" == 500000000), strings case-insensitively."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    number_a, number_b = parse_number(a), parse_number(b)
    if number_a is not None and number_b is not None:
        return float(number_a) == float(number_b)
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    return a == b


# ---- checks before any process starts ------------------------------------------------------------------------


class Resolved(NamedTuple):
    """A config resolved for a world size with its "auto" values left to the integration that fills them."""

    config: dict[str, Any]
    """The resolved DeepSpeed config (JSON form) with each "auto" value put back as "auto"."""
    auto_keys: list[str]
    """Dotted keys still "auto": the Trainer / `ZeroAccelerator.prepare` fill them when the run starts."""


def resolve_leaving_auto(config: ZeroConfig | Mapping[str, Any], world_size: int) -> Resolved:
    """Applies every rule `resolve_config` applies at `world_size` to the values that are set, leaving "auto" alone.

    An "auto" value is dropped for the check (the rules then see the default, or infer the batch size DeepSpeed's
    way) and put back in the result, so a config the Trainer will complete passes while a rule that cannot hold
    whatever the Trainer fills (`train_batch_size` 32 with micro 4 x accumulation 8 x 2 processes) fails here,
    before any process starts, instead of on every rank.

    Raises:
        ZeroConfigError: every problem `resolve_config` finds in the values that are set.
    """
    validated = config if isinstance(config, ZeroConfig) else ZeroConfig.from_any(dict(config))
    autos = validated.auto_keys()
    concrete = validated.to_dict()
    for path in autos:
        node, key = _find_node(concrete, path)
        if node is not None:
            del node[key]
    resolved = resolve_config(ZeroConfig.from_any(concrete), world_size=world_size).to_dict()
    for path in autos:
        node, key = _find_node(resolved, path)
        if isinstance(node, dict):
            node[key] = "auto"
    return Resolved(resolved, autos)


def nvme_path_problems(config: Mapping[str, Any]) -> list[str]:
    """NVMe folders that cannot exist on this machine: a path below a regular file (e.g. `/data/ckpt.bin/swap`).

    Checked by the launcher before it starts any process; the ranks check the rest (writable, room) themselves.
    """
    zero = config.get("zero_optimization")
    problems = []
    for block in _OFFLOAD_BLOCKS:
        offload = zero.get(block) if isinstance(zero, Mapping) else None
        if not isinstance(offload, Mapping) or str(offload.get("device")).lower() != "nvme":
            continue
        path = offload.get("nvme_path")
        if not isinstance(path, str) or path.lower() == "none":
            continue
        blocker = next((p for p in (Path(path), *Path(path).parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            problems.append(
                f"zero_optimization.{block}.nvme_path={path!r}: {str(blocker)!r} is a file, not a folder, so no "
                "folder can be made there: set the path to a folder on a fast local disk"
            )
    return problems


# ---- the environment -----------------------------------------------------------------------------------------------


def plugin_env(built: BuiltConfig) -> dict[str, str]:
    """The environment that hands `built` to every rank: `ACCELERATE_ZERO_CONFIG` and `ACCELERATE_ZERO_<FIELD>`."""
    env = {CONFIG_ENV: json.dumps(built.deepspeed_config)}
    for name, value in built.fields.items():
        env[env_name(name)] = str(value).lower() if isinstance(value, bool) else str(value)
    return env

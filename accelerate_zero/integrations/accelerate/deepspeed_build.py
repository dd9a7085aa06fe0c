"""`ZeroSettings` -> the DeepSpeed JSON config, validated, with the rules of accelerate 1.15's `DeepSpeedPlugin`.

Pure: starts nothing, does not import accelerate. Both `accelerate-zero launch` (`launcher.py`) and `ZeroPlugin`
(`plugin.py`) build their config here, with the rules of accelerate 1.15's `DeepSpeedPlugin`
(`accelerate/utils/dataclasses.py`: `__post_init__`, `set_mixed_precision`, `_deepspeed_config_checks`):

* without a DeepSpeed config file the plugin fields generate `{"train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": GA, "gradient_clipping": CLIP,
  "zero_optimization": {"stage", "offload_optimizer", "offload_param", "stage3_gather_16bit_weights_on_model_save"}}`;
* with one (`deepspeed_config_file`) the plugin fields only fill its "auto" values, a missing
  `gradient_accumulation_steps` becomes 1, `zero_optimization` is required, and accelerate config keys the file
  owns are accelerate's "When using `deepspeed_config_file`, ..." error;
* `mixed_precision` fp16/bf16 adds or fills `fp16.enabled` / `bf16.enabled` (`DeepSpeedPlugin.set_mixed_precision`).

Differences from accelerate, on purpose:

* DeepSpeed `zero_optimization` keys written directly in the `deepspeed_config` block (overlap_comm,
  reduce_bucket_size, ...) go into `zero_optimization`, DeepSpeed's top-level settings
  (`seq_parallel_communication_data_type`, ...) into the top level (accelerate ignores both); any other unknown key
  is an error (all read in `zero_settings.py`);
* NVMe paths reach the ranks (accelerate 1.15 never exports them) and an NVMe device without a path is an error;
* a config without `gradient_accumulation_steps` takes `ZeroPlugin(gradient_accumulation_steps=...)` when one is
  given (accelerate inserts 1 and silently trains with it);
* `gradient_clipping: 0.0` is kept (accelerate drops a falsy value, and DeepSpeed 0.19's default then clips at 1.0);
* a flag or `ZeroPlugin` argument that contradicts a non-"auto" value of a DeepSpeed config file is an error
  (accelerate silently keeps the file's value);
* `steps_per_print` is not added (accelerate sets it to inf to silence DeepSpeed; accelerate_zero never prints).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

from accelerate_zero.config import ZeroConfig, ZeroConfigError
from accelerate_zero.config.fields import parse_number
from accelerate_zero.config.schema import is_auto
from accelerate_zero.integrations.accelerate.plugin_fields import FIELD_DS_KEYS, OFFLOAD_BLOCKS, find_node, set_path
from accelerate_zero.integrations.accelerate.zero_settings import TOP_LEVEL_KEYS, ZERO_KEYS, ZeroSettings


_DEFAULTS: dict[str, Any] = {
    "zero_stage": 2,
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "offload_optimizer_device": "none",
    "offload_param_device": "none",
    "zero3_save_16bit_model": False,
}
"""accelerate's `DeepSpeedPlugin` defaults; the NVMe paths default to None, `zero3_init_flag` to `stage == 3`."""

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


class BuiltConfig(NamedTuple):
    """The DeepSpeed config built from `ZeroSettings`, validated."""

    deepspeed_config: dict[str, Any]
    """DeepSpeed JSON form; "auto" values kept (the integration fills them at prepare time)."""
    zero_config: ZeroConfig
    """The same, validated by `ZeroConfig.from_any` (not resolved)."""
    fields: dict[str, Any]
    """Plugin field -> the value the config gives it (None or "auto" fields left out), incl. `zero3_init_flag`."""
    defaulted: tuple[str, ...] = ()
    """DeepSpeed key paths holding accelerate's defaults because nothing set them ([Note: two config sources] in
    integrations/transformers/training_args.py: a script's own config may differ there)."""
    launcher_precision: tuple[str, ...] = ()
    """`fp16.enabled` / `bf16.enabled` as the launcher's `mixed_precision` wrote them (not a config file's blocks):
    a script's TrainingArguments precision wins over them ([Note: the script's precision over the launcher's])."""


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
        config.update(settings.top_level)
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
    written = settings.config or {}
    precision = tuple(p for p in ("fp16.enabled", "bf16.enabled") if _has(config, p) and not _has(written, p))
    fields = _fields_of(config, values, settings)
    return BuiltConfig(config, zero_config, fields, _defaulted_paths(config, settings), precision)


def _generate(values: Mapping[str, Any], zero_keys: Mapping[str, Any]) -> dict[str, Any]:
    """accelerate's generated config (no `deepspeed_config_file`), plus the block's `zero_optimization` keys."""
    zero: dict[str, Any] = {"stage": values["zero_stage"]}
    for block in OFFLOAD_BLOCKS:
        device = values[f"{block}_device"]
        nvme_path = values.get(f"{block}_nvme_path") if device == "nvme" else None
        extra = zero_keys.get(block, {})  # not a mapping: kept, so ZeroConfig reports it
        zero[block] = {"device": device, "nvme_path": nvme_path, **extra} if isinstance(extra, Mapping) else extra
    zero["stage3_gather_16bit_weights_on_model_save"] = values["zero3_save_16bit_model"]
    zero.update({key: value for key, value in zero_keys.items() if key not in OFFLOAD_BLOCKS})
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
    # accelerate makes a missing gradient_accumulation_steps 1, and then keeps 1 whatever the plugin says. A config
    # that does not set it contradicts nobody: an explicit ZeroPlugin(gradient_accumulation_steps=...) fills it.
    explicit = "gradient_accumulation_steps" in settings.fields
    config.setdefault("gradient_accumulation_steps", "auto" if explicit else 1)
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
    zero_keys = sorted(key for key in settings.file_owned if key in ZERO_KEYS or key in TOP_LEVEL_KEYS)
    if zero_keys:
        problems.append(
            f"deepspeed_config keys {zero_keys} are ignored when using `deepspeed_config_file`: write them in "
            f"{label} (zero_optimization keys in its zero_optimization block)"
        )
    for name, path in FIELD_DS_KEYS.items():
        if path is None or values.get(name) is None:
            continue
        if settings.fields_override_config and name in settings.fields:
            set_path(config, path, values[name])
            continue
        node, key = find_node(config, path)
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
    for block in OFFLOAD_BLOCKS:
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


def _defaulted_paths(config: Mapping[str, Any], settings: ZeroSettings) -> tuple[str, ...]:
    """The keys of `config` no file, flag, accelerate config key, environment value or block key wrote: accelerate's
    defaults (stage 2, no offload, no 16-bit save, mixed precision "no")."""
    chosen = settings.fields.keys() | settings.env_fields.keys()
    paths = [path for name, path in FIELD_DS_KEYS.items() if path is not None and name not in chosen]
    if not settings.mixed_precision_set:
        paths += ["fp16.enabled", "bf16.enabled"]
    written = [settings.config or {}, {"zero_optimization": settings.zero_optimization}, settings.top_level]
    return tuple(path for path in paths if _has(config, path) and not any(_has(source, path) for source in written))


def _has(config: Mapping[str, Any], path: str) -> bool:
    node, key = find_node(config, path)
    return node is not None and key in node


def _fields_of(config: Mapping[str, Any], values: Mapping[str, Any], settings: ZeroSettings) -> dict[str, Any]:
    """The plugin fields as the built config sets them (accelerate back-fills its plugin the same way)."""
    fields: dict[str, Any] = {}
    for name, path in FIELD_DS_KEYS.items():
        node, key = find_node(config, path) if path is not None else (None, "")
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

"""The plugin fields (accelerate's `DeepSpeedPlugin` names): the DeepSpeed key each sets, and its typed value.

A field's value arrives as YAML, a flag string or an environment variable; `coerce_field` turns each into the type
the DeepSpeed config takes, or names what is wrong with it. The fields are set by the accelerate config
(`zero_settings.py`), `ZeroPlugin` arguments and the ranks' environment (`rank_env.py`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from accelerate_zero.config import ZeroConfigError
from accelerate_zero.config.fields import parse_number
from accelerate_zero.config.schema import is_auto


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
OFFLOAD_BLOCKS = ("offload_optimizer", "offload_param")
"""The DeepSpeed `zero_optimization` blocks the `<block>_device` and `<block>_nvme_path` fields set."""


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


# ---- dotted DeepSpeed keys ("zero_optimization.offload_param.device", as in FIELD_DS_KEYS) -----------------------


def find_node(config: Mapping[str, Any], path: str) -> tuple[Any, str]:
    """The dict holding the last key of `path` (None when a parent is missing or not a dict), and that key."""
    *parents, key = path.split(".")
    node: Any = config
    for name in parents:
        node = node.get(name) if isinstance(node, Mapping) else None
    return (node if isinstance(node, dict) else None), key


def set_path(config: dict[str, Any], path: str, value: Any) -> None:
    """Sets `path` in `config` in place, making (or replacing) the parent dicts it needs."""
    *parents, key = path.split(".")
    node = config
    for name in parents:
        if not isinstance(node.get(name), dict):
            node[name] = {}
        node = node[name]
    node[key] = value

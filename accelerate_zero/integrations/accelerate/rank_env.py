"""The environment that hands the built DeepSpeed config to every rank, and reading it back on a rank.

`accelerate-zero launch` exports `plugin_env(built)` before it starts the ranks; `ZeroPlugin` reads it with
`read_env` (a plugin argument wins over it). The variables are named after the plugin fields (`plugin_fields.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from accelerate_zero.config import ZeroConfigError
from accelerate_zero.integrations.accelerate.deepspeed_build import BuiltConfig
from accelerate_zero.integrations.accelerate.plugin_fields import PLUGIN_FIELDS, coerce_fields


CONFIG_ENV = "ACCELERATE_ZERO_CONFIG"
"""The DeepSpeed JSON config every rank reads (a JSON string, "auto" values kept)."""
ENV_PREFIX = "ACCELERATE_ZERO_"
"""`ACCELERATE_ZERO_<FIELD>` holds the value of each `ZeroPlugin` field (e.g. ACCELERATE_ZERO_ZERO_STAGE)."""
MOE_ENV = "ACCELERATE_ZERO_MOE_LAYER_CLS_NAMES"
DEFAULTED_ENV = "ACCELERATE_ZERO_DEFAULTED_KEYS"
PRECISION_ENV = "ACCELERATE_ZERO_LAUNCHER_PRECISION_KEYS"
"""JSON list of the exported config's key paths that hold accelerate's defaults because nothing set them."""
"""Comma-separated MoE layer class names (accelerate's `deepspeed_moe_layer_cls_names`), for stage 3 leaf modules."""


def env_name(field_name: str) -> str:
    """The environment variable of a plugin field: `zero_stage` -> `ACCELERATE_ZERO_ZERO_STAGE`."""
    return ENV_PREFIX + field_name.upper()


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


def plugin_env(built: BuiltConfig) -> dict[str, str]:
    """The environment that hands `built` to every rank: `ACCELERATE_ZERO_CONFIG`, `ACCELERATE_ZERO_<FIELD>`, and
    which of the config's keys are accelerate's defaults (`ACCELERATE_ZERO_DEFAULTED_KEYS`)."""
    env = {CONFIG_ENV: json.dumps(built.deepspeed_config), DEFAULTED_ENV: json.dumps(list(built.defaulted))}
    env[PRECISION_ENV] = json.dumps(list(built.launcher_precision))
    for name, value in built.fields.items():
        env[env_name(name)] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def read_defaulted(environ: Mapping[str, str]) -> frozenset[str]:
    """The key paths of the exported config that nobody set (`DEFAULTED_ENV`; none when it is absent or unreadable:
    then every exported key counts as chosen, the strict reading)."""
    return _paths(environ, DEFAULTED_ENV)


def read_launcher_precision(environ: Mapping[str, str]) -> frozenset[str]:
    """The exported config's `fp16.enabled` / `bf16.enabled` that the launcher's `mixed_precision` wrote
    (`PRECISION_ENV`; none when absent: then they count as the config's own)."""
    return _paths(environ, PRECISION_ENV)


def _paths(environ: Mapping[str, str], name: str) -> frozenset[str]:
    try:
        paths = json.loads(environ.get(name, "[]"))
    except json.JSONDecodeError:
        return frozenset()
    return frozenset(path for path in paths if isinstance(path, str)) if isinstance(paths, list) else frozenset()

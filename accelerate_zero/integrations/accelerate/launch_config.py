"""Accelerate config (`deepspeed_config` block, `deepspeed_config_file`) + flags -> DeepSpeed JSON + rank environment.

The public names of that translation, importable from here as before; nothing is defined here. Each step lives in
its own module, in the order a launch runs them:

* `plugin_fields.py`: the plugin fields (accelerate's `DeepSpeedPlugin` names), the DeepSpeed key each sets, and
  how a value from YAML, a flag or the environment is typed;
* `zero_settings.py`: `ZeroSettings`, and reading an accelerate config's `deepspeed_config` block and flags into it;
* `deepspeed_build.py`: `ZeroSettings` -> the validated DeepSpeed config, with accelerate's `DeepSpeedPlugin` rules
  (and the documented differences);
* `launch_checks.py`: the checks `accelerate-zero launch` runs before any process starts;
* `rank_env.py`: the environment that hands the built config to every rank, and reading it back.
"""

from accelerate_zero.integrations.accelerate.deepspeed_build import (
    FILE_OWNED_KEYS,
    BuiltConfig,
    apply_mixed_precision,
    build_deepspeed_config,
    same_value,
)
from accelerate_zero.integrations.accelerate.launch_checks import Resolved, nvme_path_problems, resolve_leaving_auto
from accelerate_zero.integrations.accelerate.plugin_fields import (
    FIELD_DS_KEYS,
    PLUGIN_FIELDS,
    coerce_field,
    coerce_fields,
)
from accelerate_zero.integrations.accelerate.rank_env import (
    CONFIG_ENV,
    ENV_PREFIX,
    MOE_ENV,
    env_name,
    plugin_env,
    read_env,
)
from accelerate_zero.integrations.accelerate.zero_settings import (
    LAUNCHER_KEYS,
    ZERO_KEYS,
    ZeroSettings,
    read_deepspeed_config,
    settings_from_accelerate,
)


__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "FIELD_DS_KEYS",
    "FILE_OWNED_KEYS",
    "LAUNCHER_KEYS",
    "MOE_ENV",
    "PLUGIN_FIELDS",
    "ZERO_KEYS",
    "BuiltConfig",
    "Resolved",
    "ZeroSettings",
    "apply_mixed_precision",
    "build_deepspeed_config",
    "coerce_field",
    "coerce_fields",
    "env_name",
    "nvme_path_problems",
    "plugin_env",
    "read_deepspeed_config",
    "read_env",
    "resolve_leaving_auto",
    "same_value",
    "settings_from_accelerate",
]

"""Training under the user's own `accelerate launch` with a DeepSpeed config: take over the ZeRO settings accelerate
exported for DeepSpeed, and switch accelerate off its DeepSpeed path, before anything imports deepspeed.

[Note: adopting accelerate's DeepSpeed launch]
With deepspeed installed, `accelerate launch --config_file zero3.yaml train.py` (`distributed_type: DEEPSPEED`)
starts the ranks through accelerate's DeepSpeed launcher, which exports the YAML's DeepSpeed settings as
`ACCELERATE_DEEPSPEED_*` variables (plus `ACCELERATE_GRADIENT_*`, `ACCELERATE_MIXED_PRECISION`,
`ACCELERATE_CONFIG_DS_FIELDS`) and `ACCELERATE_USE_DEEPSPEED=true`, which makes `TrainingArguments` build a
`DeepSpeedPlugin` and `Accelerator()` initialise DeepSpeed. `adopt_accelerate_deepspeed_launch` runs first thing in
`ZeroPlugin`, `ZeroAccelerator` and our `TrainingArguments`: it builds the DeepSpeed config from those variables
with the rules `accelerate-zero launch` applies to the YAML (accelerate's `DeepSpeedPlugin` rules,
`deepspeed_build.py`), exports it as `accelerate-zero launch` would (`ACCELERATE_ZERO_CONFIG`,
`ACCELERATE_ZERO_<FIELD>`), and sets `ACCELERATE_USE_DEEPSPEED=false` in this process, so accelerate sees
MULTI_GPU/MULTI_CPU and nothing imports deepspeed. accelerate 1.15 does not export what it ignores: DeepSpeed keys
written directly in the YAML's `deepspeed_config` block (`overlap_comm`, ...) and the NVMe paths do not reach the
ranks this way (they do with `accelerate-zero launch`, or in a `deepspeed_config_file`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

from accelerate_zero.engine.groups import has_accelerator
from accelerate_zero.integrations.accelerate.deepspeed_build import build_deepspeed_config
from accelerate_zero.integrations.accelerate.rank_env import CONFIG_ENV, MOE_ENV, plugin_env
from accelerate_zero.integrations.accelerate.zero_settings import ZeroSettings, settings_from_accelerate


logger = logging.getLogger(__name__)

USE_DEEPSPEED_ENV = "ACCELERATE_USE_DEEPSPEED"

ACCELERATE_ENV = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
}
"""`DeepSpeedPlugin` field -> the variable accelerate's DeepSpeed launcher exports it in (accelerate 1.15)."""


def launched_for_deepspeed(environ: MutableMapping[str, str] | None = None) -> bool:
    """True when accelerate's DeepSpeed launcher started this process (`ACCELERATE_USE_DEEPSPEED=true`)."""
    environ = os.environ if environ is None else environ
    return environ.get(USE_DEEPSPEED_ENV, "false").lower() == "true"


def adopt_accelerate_deepspeed_launch(environ: MutableMapping[str, str] | None = None) -> bool:
    """Turns accelerate's DeepSpeed launch environment into ours ([Note: adopting accelerate's DeepSpeed launch]).

    Returns:
        True when it did (the process was started by `accelerate launch` with a DeepSpeed config).

    Raises:
        ZeroConfigError: the exported settings are invalid (every problem named, as `accelerate-zero launch` does).
    """
    environ = os.environ if environ is None else environ
    if not launched_for_deepspeed(environ):
        return False
    if CONFIG_ENV not in environ:
        built = build_deepspeed_config(_settings(environ))
        environ.update(plugin_env(built))
        if environ.get("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"):
            environ[MOE_ENV] = environ["ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"]
        if int(environ.get("RANK", "0")) == 0:
            logger.warning(
                "`accelerate launch` with a DeepSpeed config: training with accelerate_zero's ZeRO engine (stage %s); "
                "deepspeed is not used",
                built.zero_config.zero_optimization.stage,
            )
    environ[USE_DEEPSPEED_ENV] = "false"
    if not has_accelerator():
        environ["ACCELERATE_USE_CPU"] = "true"  # accelerate forms the gloo group with every rank (MULTI_CPU)
    return True


def _settings(environ: MutableMapping[str, str]) -> ZeroSettings:
    values = {name: environ[var] for name, var in ACCELERATE_ENV.items() if var in environ}
    yaml_keys = _config_fields(environ.get("ACCELERATE_CONFIG_DS_FIELDS", ""))
    block = {name: value for name, value in values.items() if name in yaml_keys}
    flags = {name: value for name, value in values.items() if name not in yaml_keys}
    mixed_precision = environ.get("ACCELERATE_MIXED_PRECISION")
    from_yaml = "mixed_precision" in yaml_keys
    if not from_yaml:
        flags["mixed_precision"] = mixed_precision
    return settings_from_accelerate(
        block,
        flags,
        config_mixed_precision=mixed_precision if from_yaml else None,
        source="the accelerate config (as `accelerate launch` exported it)",
    )


def _config_fields(text: str) -> set[str]:
    """accelerate's ACCELERATE_CONFIG_DS_FIELDS: the accelerate config's DeepSpeed keys, comma-separated."""
    return {part.strip(" []'\"") for part in text.split(",") if part.strip(" []'\"")}

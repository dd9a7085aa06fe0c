"""The run an estimate is made for, from a loaded DeepSpeed config: bucket sizes, stage 3 thresholds, dtypes."""

from __future__ import annotations

from typing import Any

from accelerate_zero.config import ZeroConfig
from accelerate_zero.config.hidden_size import hidden_size_autos
from accelerate_zero.config.schema import ZeroOptimizationConfig, is_auto
from accelerate_zero.debug.estimate import Architecture, TrainingSetup


def setup_from_config(
    config: ZeroConfig,
    world_size: int,
    mixed_precision: str | None,
    optimizer: str,
    architecture: Architecture | None,
) -> tuple[TrainingSetup, list[str]]:
    """The `TrainingSetup` `config` describes on `world_size` ranks, and notes on the "auto" values read as defaults.

    Args:
        mixed_precision: "no", "fp16" or "bf16" from a flag; None: the config's bf16/fp16 blocks (bf16 when "auto").
        architecture: fills the hidden-size "auto" values as transformers' DeepSpeed integration does; None: they
            are read as the defaults.
    """
    if architecture is not None:
        # what transformers' DeepSpeed integration fills from the model's hidden size when a key is "auto"
        config = config.fill_auto(hidden_size_autos(architecture.hidden_size))
    raw, defaults = config.zero_optimization.to_dict(), ZeroOptimizationConfig().to_dict()
    left = sorted(key for key, value in raw.items() if is_auto(value))
    raw.update({key: defaults[key] for key in left})
    raw.update(stage=0, offload_param=None, offload_optimizer=None)  # every stage and offload is estimated
    notes = [f'"auto" read as the default for zero_optimization.{key}' for key in left if key != "stage"]
    setup = TrainingSetup(
        world_size,
        mixed_precision or _precision_of(config),
        optimizer,
        zero=ZeroConfig.from_any({"zero_optimization": raw}).zero_optimization,
        grad_accum_dtype=_concrete(config.data_types.grad_accum_dtype),
        communication_data_type=_concrete(config.communication_data_type),
    )
    return setup, notes


def _precision_of(config: ZeroConfig) -> str:
    for block in ("bf16", "fp16"):
        if getattr(config, block).enabled is True:
            return block
    unset = any(is_auto(getattr(config, block).enabled) for block in ("bf16", "fp16"))
    return "bf16" if unset else "no"


def _concrete(value: Any) -> Any:
    return None if is_auto(value) else value

"""Rules between values: refused features and load-time rules (`static_problems`), then `resolve_config`.

`static_problems` runs inside `ZeroConfig.from_any`, before anything else sees the config. `resolve_config` runs when
the engine is built and knows the world size: it turns every runtime-dependent default into a concrete value and
reports every "auto" nothing filled. Each rule is one small function; all problems are reported together.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any, NamedTuple

from accelerate_zero.config.schema import (
    ZeroConfig,
    ZeroConfigError,
    ZeroOptimizationConfig,
    default_overlap_comm,
    is_auto,
)


class RefusedFeature(NamedTuple):
    """A DeepSpeed option accelerate_zero will never implement: only `default` (or what `accepts` allows) passes."""

    default: Any
    reason: str
    accepts: Callable[[Any], bool] | None = None


_NOT_IMPLEMENTED = "is a DeepSpeed feature accelerate_zero does not implement"
_FP32_MASTER = "accelerate_zero always keeps fp32 master weights, gradients and optimizer states"
_NO_PATCH = "accelerate_zero never patches nn.Module"

REFUSED_FEATURES: dict[str, RefusedFeature] = {
    "zero_optimization.legacy_stage1": RefusedFeature(False, "DeepSpeed removed the legacy stage 1; use stage 1"),
    "zero_optimization.zero_hpz_partition_size": RefusedFeature(
        1, f"ZeRO++ hierarchical partitioning (hpZ) {_NOT_IMPLEMENTED}", lambda v: v <= 1
    ),
    "zero_optimization.zero_quantized_weights": RefusedFeature(
        False, f"ZeRO++ quantized weights (qwZ) {_NOT_IMPLEMENTED}"
    ),
    "zero_optimization.zero_quantized_nontrainable_weights": RefusedFeature(
        False, f"quantized storage of frozen weights {_NOT_IMPLEMENTED}"
    ),
    "zero_optimization.zero_quantized_gradients": RefusedFeature(
        False, f"ZeRO++ quantized gradients (qgZ) {_NOT_IMPLEMENTED}"
    ),
    "zero_optimization.zeropp_loco_param": RefusedFeature(None, f"LoCo-ZeRO++ {_NOT_IMPLEMENTED}"),
    "zero_optimization.mics_shard_size": RefusedFeature(-1, f"MiCS {_NOT_IMPLEMENTED}", lambda v: v <= 0),
    "zero_optimization.mics_hierarchical_params_gather": RefusedFeature(False, f"MiCS {_NOT_IMPLEMENTED}"),
    "zero_optimization.zenflow": RefusedFeature(None, f"ZenFlow {_NOT_IMPLEMENTED}"),
    "zero_optimization.elastic_checkpoint": RefusedFeature(
        False, "DeepSpeed's legacy elastic checkpoints are not implemented (use universal checkpoints)"
    ),
    "zero_optimization.use_multi_rank_bucket_allreduce": RefusedFeature(
        True, "accelerate_zero reduces gradients with a real reduce-scatter"
    ),
    "zero_optimization.memory_efficient_linear": RefusedFeature(True, _NO_PATCH),
    "zero_optimization.override_module_apply": RefusedFeature(True, _NO_PATCH),
    "zero_optimization.offload_optimizer.super_offload": RefusedFeature(
        False, f"SuperOffload (DeepSpeed's Superchip CPU Adam) {_NOT_IMPLEMENTED}"
    ),
    "fp16.fp16_master_weights_and_grads": RefusedFeature(False, _FP32_MASTER),
    "bf16.bf16_master_weights_and_grads": RefusedFeature(False, _FP32_MASTER),
    "bf16.bf16_optimizer_states": RefusedFeature(False, _FP32_MASTER),
    "bf16.immediate_grad_update": RefusedFeature(
        True, "accelerate_zero always accumulates gradients as they are produced"
    ),
    "dataloader_drop_last": RefusedFeature(
        False, "accelerate_zero.initialize takes no training_data; set drop_last on your DataLoader"
    ),
}
"""Key path -> the accepted value and why anything else is refused. Extend it to refuse another DeepSpeed option."""

_MISSING = object()


def static_problems(config: ZeroConfig) -> list[str]:
    """Every load-time rule between values (no runtime facts needed); run by `ZeroConfig.from_any`."""
    return [
        *_refused_problems(config),
        *_precision_problems(config),
        *_loss_scale_problems(config),
        *_parallel_write_problems(config),
        *_optimizer_block_problems(config),
    ]


def _get(config: ZeroConfig, path: str) -> Any:
    value: Any = config
    for name in path.split("."):
        value = getattr(value, name) if value is not None else _MISSING
    return value


def _refused_problems(config: ZeroConfig) -> list[str]:
    problems = []
    for path, refused in REFUSED_FEATURES.items():
        value = _get(config, path)
        if value is _MISSING or is_auto(value):
            continue
        if refused.accepts(value) if refused.accepts is not None else value == refused.default:
            continue
        default = json.dumps(refused.default)
        problems.append(f"{path}={value!r} is not supported ({refused.reason}): remove the key or set it to {default}")
    return problems


def _precision_problems(config: ZeroConfig) -> list[str]:
    if config.fp16.enabled is True and config.bf16.enabled is True:
        return [
            "fp16.enabled and bf16.enabled are both true: bfloat16 and fp16 modes cannot be simultaneously enabled; "
            "set one of them to false"
        ]
    return []


def _loss_scale_problems(config: ZeroConfig) -> list[str]:
    fp16 = config.fp16
    if fp16.enabled is False or fp16.loss_scale != 0:
        return []  # as DeepSpeed: these only matter for dynamic loss scaling
    return [
        f"fp16.{name}={value!r}: must be > 0 when dynamic loss scaling is enabled (loss_scale=0)"
        for name, value in (("loss_scale_window", fp16.loss_scale_window), ("min_loss_scale", fp16.min_loss_scale))
        if not is_auto(value) and value <= 0
    ]


def _parallel_write_problems(config: ZeroConfig) -> list[str]:
    parallel_write = config.checkpoint.parallel_write
    problems = [
        f"unknown key 'checkpoint.parallel_write.{key}': the only key is 'pipeline_stage'; remove it"
        for key in sorted(set(parallel_write) - {"pipeline_stage"})
    ]
    stage = parallel_write.get("pipeline_stage", False)
    if not isinstance(stage, bool) and not is_auto(stage):
        problems.append(f"checkpoint.parallel_write.pipeline_stage={stage!r}: expected true or false")
    return problems


def _optimizer_block_problems(config: ZeroConfig) -> list[str]:
    from accelerate_zero.optim import factory  # imported here: the factory may import this package

    problems = []
    if config.optimizer is not None and "max_grad_norm" in config.optimizer.params:
        problems.append(
            "optimizer.params.max_grad_norm: 'max_grad_norm' is not supported as an optimizer parameter, please "
            "switch to using the top-level parameter 'gradient_clipping'"
        )
    blocks = (
        ("optimizer", config.optimizer, factory.optimizer_block_errors),
        ("scheduler", config.scheduler, factory.scheduler_block_errors),
    )
    for name, block, block_errors in blocks:
        if block is None or is_auto(block.type):
            continue
        params = {key: value for key, value in block.params.items() if key != "max_grad_norm"}
        problems.extend(m if m.startswith(name) else f"{name}: {m}" for m in block_errors(block.type, params))
    return problems


# ---- runtime resolution ------------------------------------------------------------------------------------------


def resolve_config(config: ZeroConfig, *, world_size: int) -> ZeroConfig:
    """Makes every runtime-dependent value concrete for a run on `world_size` data-parallel ranks.

    Args:
        config: a config, typically from `ZeroConfig.from_any` and `fill_auto`; it is re-validated, not modified.
        world_size: the data-parallel world size (>= 1).

    Returns:
        A new config with no "auto" left, the batch sizes inferred (DeepSpeed's rule) and `overlap_comm` set.

    Raises:
        ZeroConfigError: listing every problem: unfilled "auto" values, batch sizes that do not multiply out,
            parameter offload or partial optimizer offload below stage 3, NVMe offload without `nvme_path`.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ZeroConfigError([f"world_size={world_size!r}: must be a positive integer (the data-parallel size)"])
    resolved = ZeroConfig.from_any(config.to_dict())  # a copy, re-validated if `config` was built in code
    _resolve_stage3_autos(resolved)
    problems = [
        *_resolve_autos(resolved),
        *_resolve_batch_sizes(resolved, world_size),
        *_check_param_offload_stage(resolved),
        *_check_partial_offload(resolved),
        *_check_nvme_paths(resolved),
    ]
    if problems:
        raise ZeroConfigError(problems)
    _resolve_overlap_comm(resolved)
    # gradient_predivide_factor != 1.0 with prescale_gradients=false is valid: divide by the factor before the
    # reduction and by world_size / factor after it (DeepSpeed's meaning); nothing to resolve.
    return resolved


def _resolve_stage3_autos(config: ZeroConfig) -> None:
    """Below stage 3, an unfilled "auto" in a `stage3_*` key takes the default: transformers fills them at stage 3 only."""
    zero = config.zero_optimization
    if is_auto(zero.stage) or zero.stage == 3:
        return
    for f in dataclasses.fields(ZeroOptimizationConfig):
        if f.name.startswith("stage3_") and is_auto(getattr(zero, f.name)):
            setattr(zero, f.name, f.default)


def _resolve_autos(config: ZeroConfig) -> list[str]:
    return [
        f'"{key}" is "auto" and nothing filled it: replace "auto" with a value, or let the Trainer/accelerate '
        "integration fill it (ZeroConfig.fill_auto)"
        for key in config.auto_keys()
    ]


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _resolve_batch_sizes(config: ZeroConfig, world_size: int) -> list[str]:
    """DeepSpeed's batch rule (`_set_batch_related_parameters` + `_batch_assertion`), except that nothing given is
    fine: then gradient_accumulation_steps = 1 and the batch sizes stay None (the engine never needs them)."""
    values = [getattr(config, key) for key in _BATCH_KEYS]
    if any(is_auto(v) for v in values):
        return []  # reported by _resolve_autos
    problems = [
        f"{key}={v!r}: must be > 0" for key, v in zip(_BATCH_KEYS, values, strict=True) if v is not None and v <= 0
    ]
    if problems:
        return problems
    inferred = _infer_batch_sizes(values[0], values[1], values[2], world_size)
    if isinstance(inferred, str):
        return [inferred]
    train, micro, accumulation = inferred
    if train is not None and micro is not None and train != micro * accumulation * world_size:
        return [
            f"train_batch_size={train} != train_micro_batch_size_per_gpu={micro} * gradient_accumulation_steps="
            f"{accumulation} * world_size={world_size} (= {micro * accumulation * world_size}): fix one of them or "
            "set train_batch_size to 'auto'"
        ]
    config.train_batch_size, config.train_micro_batch_size_per_gpu = train, micro
    config.gradient_accumulation_steps = accumulation
    return []


def _infer_batch_sizes(
    train: int | None, micro: int | None, accumulation: int | None, world_size: int
) -> tuple[int | None, int | None, int] | str:
    """The missing one of the three from the others (a problem message when it is not a whole number)."""
    if train is None:
        accumulation = accumulation or 1
        return (None if micro is None else micro * accumulation * world_size), micro, accumulation
    if micro is None:
        accumulation = accumulation or 1
        divisor = accumulation * world_size
        if train % divisor:
            return _not_divisible(train, "train_micro_batch_size_per_gpu", _BATCH_KEYS[2], accumulation, world_size)
        return train, train // divisor, accumulation
    if accumulation is None:
        divisor = micro * world_size
        if train % divisor:
            return _not_divisible(train, "gradient_accumulation_steps", _BATCH_KEYS[1], micro, world_size)
        return train, micro, train // divisor
    return train, micro, accumulation


def _not_divisible(train: int, missing: str, other_key: str, other: int, world_size: int) -> str:
    return (
        f"train_batch_size={train} is not divisible by {other_key}={other} * world_size={world_size} "
        f"(= {other * world_size}), so {missing} cannot be inferred: fix one of them or set train_batch_size to 'auto'"
    )


def _resolve_overlap_comm(config: ZeroConfig) -> None:
    """An unset `overlap_comm` becomes `default_overlap_comm(stage)`."""
    zero = config.zero_optimization
    if zero.overlap_comm is None:
        zero.overlap_comm = default_overlap_comm(zero.stage)


def _check_param_offload_stage(config: ZeroConfig) -> list[str]:
    zero = config.zero_optimization
    if zero.offload_param is None or zero.offload_param.device == "none" or is_auto(zero.stage) or zero.stage == 3:
        return []
    return [
        f"zero_optimization.offload_param.device={zero.offload_param.device!r} needs zero_optimization.stage=3 "
        f"(got {zero.stage}): parameter offload only exists at stage 3; set stage to 3 or remove offload_param"
    ]


def _check_partial_offload(config: ZeroConfig) -> list[str]:
    zero = config.zero_optimization
    offload = zero.offload_optimizer
    if offload is None or is_auto(offload.ratio) or offload.ratio >= 1 or is_auto(zero.stage) or zero.stage == 3:
        return []
    return [
        f"zero_optimization.offload_optimizer.ratio={offload.ratio!r} with zero_optimization.stage={zero.stage}: "
        "Partial offloading only supported for ZeRO Stage 3. Set ratio to 1.0 or stage to 3"
    ]


def _check_nvme_paths(config: ZeroConfig) -> list[str]:
    problems = []
    for name in ("offload_param", "offload_optimizer"):
        offload = getattr(config.zero_optimization, name)
        if offload is not None and offload.device == "nvme" and not offload.nvme_path:
            problems.append(
                f"zero_optimization.{name}.device is 'nvme' but zero_optimization.{name}.nvme_path is not set: "
                "set it to a folder on a fast local disk"
            )
    return problems

"""`resolve_config`: the run-time rules between values (the load-time ones, `static_problems`, are in schema.py).

`resolve_config` runs when the engine is built and knows the world size: it turns every runtime-dependent default
into a concrete value and reports every "auto" nothing filled. Each rule is one small function; all problems are
reported together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from accelerate_zero.config.blocks import EXPERT_PARALLEL_AUTO_KEYS, Block, KeyPolicy
from accelerate_zero.config.deepspeed_keys import report_notes
from accelerate_zero.config.schema import (
    ZeroConfig,
    ZeroConfigError,
    ZeroOptimizationConfig,
    default_overlap_comm,
    is_auto,
)


# ---- runtime resolution ------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ResolvedZeroConfig(ZeroConfig):
    """A config `resolve_config` made concrete: no "auto" anywhere, the accumulation steps and `overlap_comm` set.

    Building one from values that are not concrete raises, so code typed with it (the engine) cannot meet an
    unresolved value. Make one with `resolve_config`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = [f'{key} is still "auto": resolve_config fills or reports it' for key in self.auto_keys()]
        if self.gradient_accumulation_steps is None:
            problems.append("gradient_accumulation_steps is unset: resolve_config sets it")
        if self.zero_optimization.overlap_comm is None:
            problems.append("zero_optimization.overlap_comm is unset: resolve_config sets it")
        if problems:
            raise ZeroConfigError(problems)

    def __getitem__(self, key: str) -> Any:
        """DeepSpeed's `engine.config[key]`: this config in DeepSpeed JSON form (RL frameworks read
        `engine.config["zero_optimization"]["offload_optimizer"]["device"]`); a copy, so writing it changes nothing.

        Raises:
            KeyError: `key` is not a top-level DeepSpeed config key.
        """
        return self.to_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        """`engine.config.get(key, default)`, as on DeepSpeed's config dict."""
        return self.to_dict().get(key, default)


def resolve_config(config: ZeroConfig, *, world_size: int) -> ResolvedZeroConfig:
    """Makes every runtime-dependent value concrete for a run on `world_size` data-parallel ranks.

    Args:
        config: a config, typically from `ZeroConfig.from_any` and `fill_auto`; it is re-validated, not modified.
        world_size: the data-parallel world size (>= 1).

    Returns:
        A new `ResolvedZeroConfig`: no "auto" left, the batch sizes inferred (DeepSpeed's rule), `overlap_comm` set.

    Raises:
        ZeroConfigError: listing every problem: unfilled "auto" values, batch sizes that do not multiply out,
            parameter offload below stage 3, NVMe offload without `nvme_path`.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ZeroConfigError([f"world_size={world_size!r}: must be a positive integer (the data-parallel size)"])
    resolved = ZeroConfig.from_any(config.to_dict())  # a copy, re-validated if `config` was built in code
    _resolve_stage3_autos(resolved)
    report_notes(_resolve_model_autos(resolved, ""))
    _resolve_expert_parallel_autos(resolved)
    _resolve_sequence_parallel_dtype(resolved)
    problems = [
        *_resolve_autos(resolved),
        *_check_sequence_parallel(resolved, world_size),
        *_resolve_batch_sizes(resolved, data_parallel_ranks(resolved, world_size)),
        *_check_param_offload_stage(resolved),
        *_check_nvme_paths(resolved),
        *_check_hierarchical(resolved, world_size),
        *_check_expert_parallel(resolved, world_size),
    ]
    if problems:
        raise ZeroConfigError(problems)
    _resolve_overlap_comm(resolved)
    # gradient_predivide_factor != 1.0 with prescale_gradients=false is valid: divide by the factor before the
    # reduction and by world_size / factor after it (DeepSpeed's meaning); nothing to resolve.
    return ResolvedZeroConfig.from_any(resolved.to_dict())


def _resolve_stage3_autos(config: ZeroConfig) -> None:
    """Below stage 3, an unfilled "auto" in a `stage3_*` key takes the default: transformers fills them at stage 3 only."""
    zero = config.zero_optimization
    if is_auto(zero.stage) or zero.stage == 3:
        return
    for f in dataclasses.fields(ZeroOptimizationConfig):
        if f.name.startswith("stage3_") and is_auto(getattr(zero, f.name)):
            setattr(zero, f.name, f.default)


def _resolve_model_autos(block: Block, path: str) -> list[str]:
    """An "auto" nothing filled in a block DeepSpeed validates with a pydantic model takes the default, as there
    (`DeepSpeedConfigModel` drops "auto" values: OpenRLHF writes `"sub_group_size": "auto"` and relies on it);
    returns one note per key ([Note: DeepSpeed's config rule] in config/deepspeed_keys.py)."""
    notes = []
    for f in dataclasses.fields(block):  # type: ignore[arg-type]
        value, key = getattr(block, f.name), f"{path}.{f.name}" if path else f.name
        if isinstance(value, Block):
            notes += _resolve_model_autos(value, key)
        elif is_auto(value) and path and type(block)._KEYS is KeyPolicy.DEEPSPEED_MODEL:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(block, f.name, default)
            notes.append(f'{key} is "auto" and nothing filled it: it takes the default {default!r}, as in DeepSpeed')
    return notes


def _resolve_sequence_parallel_dtype(config: ZeroConfig) -> None:
    """DeepSpeed reduces gradients in `seq_parallel_communication_data_type` under sequence parallelism; the data
    types' "auto" of DeepSpeed 0.19.8 (`keep_in_fp32_modules`) means the model's list, None here."""
    if is_auto(config.data_types.keep_in_fp32_modules):
        config.data_types.keep_in_fp32_modules = None
    sp, dtype = config.sequence_parallel_size, config.seq_parallel_communication_data_type
    if not is_auto(sp) and sp > 1 and dtype is not None and not is_auto(dtype):
        config.communication_data_type = dtype


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


def data_parallel_ranks(config: ZeroConfig, world_size: int) -> int:
    """The ranks the batch rule counts (`data_parallel_size` of the config's `sequence_parallel_size`)."""
    size = config.sequence_parallel_size
    return world_size if is_auto(size) else data_parallel_size(world_size, size)


def data_parallel_size(world_size: int, sequence_parallel_size: int | None) -> int:
    """world size / sequence_parallel_size: the ranks of a sequence-parallel group share their batches (DeepSpeed's
    rule). The world size when that size does not divide it: `resolve_config` then reports that size alone, and
    every batch value filled from this count stays consistent (no second error blaming an "auto" batch size)."""
    size = sequence_parallel_size or 1
    return world_size // size if world_size % size == 0 else world_size


def _check_sequence_parallel(config: ZeroConfig, world_size: int) -> list[str]:
    """Ranks sharing a sequence (accelerate_zero/sequence) are not data-parallel ranks: DeepSpeed's batch rule
    counts world size / sequence_parallel_size."""
    size = config.sequence_parallel_size
    if is_auto(size) or world_size % size == 0:
        return []
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return [f"sequence_parallel_size={size} does not divide the {world_size} ranks: use one of {divisors}"]


def _check_hierarchical(config: ZeroConfig, world_size: int) -> list[str]:
    """hpZ and MiCS ([Note: the three hierarchical layouts] in engine/layout.py): stage 3, a divisor of the
    world size, not both."""
    zero = config.zero_optimization
    # Off as in DeepSpeed: hpZ at a partition size of 0 or 1, MiCS at a shard size <= 0.
    asked = [
        (key, value)
        for key, value, first_on in (
            ("zero_hpz_partition_size", zero.zero_hpz_partition_size, 2),
            ("mics_shard_size", zero.mics_shard_size, 1),
        )
        if not is_auto(value) and value >= first_on
    ]
    problems = []
    for key, value in asked:
        if not is_auto(zero.stage) and zero.stage != 3:
            problems.append(
                f"zero_optimization.{key}={value} needs zero_optimization.stage=3 (got {zero.stage}): it shards "
                "parameters; set stage to 3 or remove the key"
            )
        elif world_size % value:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            problems.append(
                f"zero_optimization.{key}={value} does not divide the {world_size} data-parallel ranks: use one of "
                f"{divisors} (usually the ranks per node)"
            )
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        if getattr(zero, key) is True and not is_auto(zero.stage) and zero.stage != 3:
            problems.append(
                f"zero_optimization.{key}=true needs zero_optimization.stage=3 (got {zero.stage}): ZeRO++ quantizes "
                "the collectives of partitioned parameters; set stage to 3 or remove the key"
            )
    if zero.zero_quantized_weights is True and zero.stage3_use_all_reduce_for_fetch_params is True:
        problems.append(
            "zero_optimization.zero_quantized_weights=true with stage3_use_all_reduce_for_fetch_params=true: "
            "int8 weights travel in an all-gather, not an all-reduce; set one of them to false"
        )
    if zero.zero_quantized_gradients is True and not is_auto(zero.mics_shard_size) and zero.mics_shard_size > 0:
        problems.append(
            "zero_optimization.zero_quantized_gradients=true with mics_shard_size: the two-level quantized "
            "reduce-scatter needs the gradients sharded over every rank; use zero_hpz_partition_size instead of "
            "mics_shard_size, or remove zero_quantized_gradients"
        )
    if len(asked) == 2:
        problems.append(
            "zero_optimization.zero_hpz_partition_size and zero_optimization.mics_shard_size are both set: hpZ and "
            "MiCS are two different layouts (as in DeepSpeed); keep one"
        )
    return problems


def _resolve_expert_parallel_autos(config: ZeroConfig) -> None:
    """AutoEP's "auto" router keys mean the model's values: None here (nothing for accelerate to fill)."""
    for key in EXPERT_PARALLEL_AUTO_KEYS:
        if is_auto(getattr(config.expert_parallel, key)):
            setattr(config.expert_parallel, key, None)


# DeepSpeed 0.19.8's AutoEP presets (module_inject/auto_ep_presets): their names are the models' `model_type`.
EXPERT_PARALLEL_PRESETS = ("mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3", "minimax_m3")


def _check_expert_parallel(config: ZeroConfig, world_size: int) -> list[str]:
    """Expert parallelism ([Note: expert parallelism in the engine] in engine/experts/partition.py): ZeRO stages 1-3 on
    a flat layout, `autoep_size` a divisor of the world size."""
    ep = config.expert_parallel
    if not ep.enabled:
        return []
    zero, problems = config.zero_optimization, []
    if world_size % ep.autoep_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        problems.append(
            f"expert_parallel.autoep_size={ep.autoep_size} does not divide the {world_size} ranks: use one of {divisors}"
        )
    if not is_auto(zero.stage) and zero.stage == 0:
        problems.append(
            "expert_parallel.enabled=true needs zero_optimization.stage 1, 2 or 3 (got 0): the experts' states are "
            "partitioned over the ranks holding the same experts; set a stage"
        )
    layouts = (("zero_hpz_partition_size", 2), ("mics_shard_size", 1))
    for key, first_on in layouts:
        value = getattr(zero, key)
        if not is_auto(value) and value >= first_on:
            problems.append(
                f"expert_parallel.enabled=true with zero_optimization.{key}={value}: expert parallelism runs on the "
                "flat layout only; remove one of them"
            )
    if zero.zero_quantized_gradients is True:
        problems.append(
            "expert_parallel.enabled=true with zero_optimization.zero_quantized_gradients=true: the experts' gradients "
            "are reduced over their own ranks, which the two-level quantized reduce-scatter does not know; remove one"
        )
    if ep.preset_model is not None and ep.preset_model not in EXPERT_PARALLEL_PRESETS:
        problems.append(
            f"expert_parallel.preset_model={ep.preset_model!r} is not one of DeepSpeed's AutoEP presets "
            f"{list(EXPERT_PARALLEL_PRESETS)}: remove the key (layers are found by structure) or fix the name"
        )
    return problems

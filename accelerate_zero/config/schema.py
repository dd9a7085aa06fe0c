"""Typed ZeRO config: one `kw_only` dataclass per block of a DeepSpeed JSON config.

Attribute names are the DeepSpeed JSON key names users write (the long `stage3_*` names), so a DeepSpeed config
reads the same here (`cfg.zero_optimization.stage3_prefetch_bucket_size`, `cfg.fp16.initial_scale_power`).

Defaults mirror the code of **DeepSpeed 0.19.6** (deepspeedai/DeepSpeed@edaa722; where code and docs disagree,
code wins). What changed since 0.16.5 (microsoft/DeepSpeed@38327e07):

* `gradient_clipping` is 1.0 (0.16.5: 0.0).
* `offload_param.pin_memory` and `offload_optimizer.pin_memory` are True (0.16.5: False).
* `bf16.check_grad_overflow` (new, default True), `bf16.bf16_master_weights_and_grads`, `bf16.bf16_optimizer_states`,
  `offload_optimizer.super_offload`, `offload_optimizer.cpuadam_cores_perc`, `zero_optimization.zenflow`,
  `stage3_allgather_sequential`, `enable_sanity_checks`, `save_muon_momentum_buffer_in_memory` and `leaf_module`
  do not exist in 0.16.5.
* `fp16` / `bf16` reject unknown keys (0.16.5 ignored them) and `fp16.loss_scale` is a float >= 0.

Deliberate differences from DeepSpeed 0.19.6:

* `offload_optimizer.cpuadam_cores_perc` defaults to None, all of the rank's cores (DeepSpeed: 0.8, read only by
  SuperOffload, which is refused): a number sets the share of the rank's cores the host step uses.
* `bf16.immediate_grad_update` defaults to True (DeepSpeed's code: False): accelerate_zero always accumulates
  gradients as they are produced, so `false` is refused (see `config.schema.REFUSED_FEATURES`).
* The string `"auto"` (`AUTO`) is accepted for every leaf value and kept until `ZeroConfig.fill_auto` replaces it;
  `config.resolve.resolve_config` reports any left (DeepSpeed silently replaces it with the default).
  Annotations give the type of a resolved value.
* Every problem is collected and raised together as one `ZeroConfigError` (DeepSpeed stops at the first).
* [Note: gradient reduction overlaps backward by default]: when the config does not say, `reduce_bucket_size` is
  5e7 elements (DeepSpeed: 5e8) and `overlap_comm` is true at every stage (DeepSpeed: at stage 3 only). With 5e8 a
  model under 500M parameters is one bucket, reduced after backward has finished; with overlap off each bucket's
  reduction stops backward until it is done. Measured at stage 2 on 2 ranks, 101M parameters (bench/README.md,
  `bench/stage2_overlap.py`): these defaults take 0.71-0.76x the step time of DeepSpeed's. It also holds less:
  three 5e7-element buckets in flight are 0.3x one 5e8 bucket. A value the config writes is honoured as DeepSpeed
  honours it (`overlap_comm: false` waits for each reduction).

The blocks are in `config/blocks.py`; each validates and normalizes its own fields in `__post_init__` ("5e8" ->
500000000, "warn" -> "WARN"), from its annotations and the constraints in each field's metadata (`config/fields.py`).
Key spelling and file reading are `config/loading.py`; the load-time rules between values are at the end of this
module (`static_problems`, run by `ZeroConfig.from_any`), the run-time ones in `config/resolve.py`. The modules import
one way: values <- fields <- blocks (monitor_blocks) <- deepspeed_keys <- loading <- refusals <- schema <- resolve.
[Note: DeepSpeed's config rule] (config/deepspeed_keys.py) says what happens to each key DeepSpeed knows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from accelerate_zero.config.blocks import (
    DEFAULT_GRAD_ACCUM_DTYPE,
    DEFAULT_REDUCE_BUCKET_SIZE,
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    Block,
    CheckpointConfig,
    DataType,
    DataTypesConfig,
    ExpertParallelConfig,
    FP16Config,
    LeafModuleConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    SequenceTilingConfig,
    ZeroOptimizationConfig,
    _f,
    default_overlap_comm,
)
from accelerate_zero.config.compile_block import CompileConfig
from accelerate_zero.config.deepspeed_keys import library_problems
from accelerate_zero.config.loading import auto_keys, filled_autos, load_config
from accelerate_zero.config.monitor_blocks import (
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from accelerate_zero.config.refusals import REFUSED_FEATURES, RefusedFeature
from accelerate_zero.config.values import AUTO, ZeroConfigError, is_auto, join_path


if TYPE_CHECKING:
    import torch


__all__ = [
    "AUTO",
    "RefusedFeature",
    "ActivationCheckpointingConfig",
    "ExpertParallelConfig",
    "DEFAULT_GRAD_ACCUM_DTYPE",
    "DEFAULT_REDUCE_BUCKET_SIZE",
    "REFUSED_FEATURES",
    "AioConfig",
    "BF16Config",
    "CheckpointConfig",
    "CompileConfig",
    "SequenceTilingConfig",
    "DataTypesConfig",
    "FP16Config",
    "LeafModuleConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroOptimizationConfig",
    "default_overlap_comm",
    "is_auto",
    "join_path",
    "static_problems",
]


@dataclass(kw_only=True)
class ZeroConfig(Block):
    """A whole DeepSpeed-compatible ZeRO config; build it with `ZeroConfig.from_any`."""

    train_batch_size: int | None = None
    """Global batch: micro batch * gradient accumulation * world size; None means derived or unused."""
    train_micro_batch_size_per_gpu: int | None = None
    """Batch per rank per forward; None means derived or unused."""
    gradient_accumulation_steps: int | None = None
    """Micro batches per optimizer step; None until resolved (then 1 unless derivable)."""
    gradient_clipping: float = _f(1.0, ge=0)
    """Global gradient-norm clip; 0 disables (DeepSpeed 0.16.5 default: 0.0)."""
    fp16: FP16Config = _f(factory=FP16Config)
    """fp16 mixed precision."""
    bf16: BF16Config = _f(factory=BF16Config)
    """bf16 mixed precision."""
    optimizer: OptimizerConfig | None = None
    """The optimizer to build; None means the caller passes its own."""
    scheduler: SchedulerConfig | None = None
    """The LR scheduler to build; None means none or the caller's."""
    zero_optimization: ZeroOptimizationConfig = _f(factory=ZeroOptimizationConfig)
    """ZeRO stage, buckets and offload."""
    sequence_parallel_size: int = _f(1, ge=1)
    """Ulysses sequence parallelism (DeepSpeed's key): groups of this many consecutive ranks share each sequence
    (accelerate_zero/sequence); the batch rule counts world size / this many data-parallel ranks."""
    sequence_tiling: SequenceTilingConfig = _f(factory=SequenceTilingConfig)
    """MLP, logits and loss in tiles along the sequence, activations on the host (ours: `ZeroAccelerator`, the
    Trainer)."""
    steps_per_print: int | None = _f(None, ge=1, inf_is_none=True)
    """Log every this many steps; None (or inf, as accelerate writes) never."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step."""
    memory_breakdown: bool = False
    """Log memory usage."""
    zero_allow_untested_optimizer: bool = False
    """Accept a client optimizer DeepSpeed has not tested with ZeRO."""
    zero_force_ds_cpu_optimizer: bool = True
    """DeepSpeed requires its CPU Adam with optimizer offload; kept for compatibility."""
    communication_data_type: DataType | None = _f(None, case="lower")
    """Dtype of gradient communication; None means the gradient accumulation dtype (no cast copy)."""
    seq_parallel_communication_data_type: DataType | None = _f(None, case="lower")
    """With `sequence_parallel_size` > 1 DeepSpeed reduces gradients in this dtype (its default: fp32) instead of
    `communication_data_type`; resolve_config does the same. None: the gradient accumulation dtype, fp32 unless
    `data_types.grad_accum_dtype` says otherwise, as DeepSpeed's default."""
    prescale_gradients: bool = False
    """Divide gradients by the world size before (instead of after) reduction."""
    gradient_predivide_factor: float = _f(1.0, gt=0)
    """Divide gradients by this before reduction and by world_size/factor after."""
    data_types: DataTypesConfig = _f(factory=DataTypesConfig)
    """Engine buffer dtypes."""
    checkpoint: CheckpointConfig = _f(factory=CheckpointConfig)
    """Checkpoint options."""
    dataloader_drop_last: bool = False
    """`drop_last` of the loader `accelerate_zero.deepspeed.initialize(training_data=...)` builds
    (`engine.deepspeed_io`), as in DeepSpeed; nothing else reads it (`accelerate_zero.initialize` takes no
    `training_data`: set drop_last on your DataLoader)."""
    aio: AioConfig = _f(factory=AioConfig)
    """Asynchronous file IO for NVMe offload."""
    activation_checkpointing: ActivationCheckpointingConfig = _f(factory=ActivationCheckpointingConfig)
    """DeepSpeed's activation checkpointing block: `cpu_checkpointing` keeps what backward needs in host memory."""
    expert_parallel: ExpertParallelConfig = _f(factory=ExpertParallelConfig)
    """DeepSpeed's AutoEP block: each MoE layer's experts split over `autoep_size` ranks (accelerate_zero/engine/experts)."""
    tensorboard: TensorBoardConfig = _f(factory=TensorBoardConfig)
    """The engine's events as TensorBoard scalars (accelerate_zero/monitor)."""
    wandb: WandbConfig = _f(factory=WandbConfig)
    """The engine's events logged to Weights & Biases (needs wandb)."""
    csv_monitor: CSVMonitorConfig = _f(factory=CSVMonitorConfig)
    """The engine's events as CSV files."""
    comet: CometConfig = _f(factory=CometConfig)
    """The engine's events logged to Comet (needs comet_ml)."""
    comms_logger: CommsLoggerConfig = _f(factory=CommsLoggerConfig)
    """Counts, sizes and times of the engine's collectives."""
    flops_profiler: FlopsProfilerConfig = _f(factory=FlopsProfilerConfig)
    """The model's floating-point operations, measured at one step."""

    notes: ClassVar[tuple[str, ...]] = ()
    """What `from_any` accepted without using it (keys DeepSpeed ignores too, blocks that are off), one line each
    ([Note: DeepSpeed's config rule] in config/deepspeed_keys.py); not part of the config (`to_dict` leaves it
    out)."""
    compile: CompileConfig = _f(factory=CompileConfig)
    """DeepSpeed's DeepCompile block: defaults only; `engine.compile()` compiles (config/compile_block.py)."""

    @classmethod
    def from_any(cls, source: ZeroConfig | Mapping[str, Any] | str | os.PathLike[str]) -> ZeroConfig:
        """A new validated config ("auto" kept) from a DeepSpeed config dict, a .json/.yaml/.yml path or a ZeroConfig.

        Raises:
            ZeroConfigError: listing every problem (unknown keys, types, ranges, refused features, ...).
        """
        return load_config(cls, source, static_problems)

    def auto_keys(self) -> list[str]:
        """Dotted paths whose value is still "auto", in config order, e.g. ["fp16.enabled", "optimizer.params.lr"]."""
        return auto_keys(self)

    def fill_auto(self, values: Mapping[str, Any]) -> ZeroConfig:
        """Returns a new config where each dotted key of `values` that is currently "auto" takes that value.

        Keys that are not "auto" keep their value. Keys whose parent block is absent (e.g. "optimizer.params.lr"
        without an `optimizer` block) are skipped, as transformers does: no block is created.

        Raises:
            ZeroConfigError: if a filled value is invalid (the result is validated like `from_any`).
        """
        return type(self).from_any(filled_autos(self, values))

    @property
    def compute_dtype(self) -> torch.dtype:
        """torch.bfloat16 if bf16 is enabled, torch.float16 if fp16 is, else torch.float32.

        Raises:
            ValueError: while `fp16.enabled` or `bf16.enabled` is still "auto".
        """
        import torch

        for block in ("bf16", "fp16"):
            if is_auto(getattr(self, block).enabled):
                raise ValueError(f'{block}.enabled is "auto": fill it (ZeroConfig.fill_auto) before asking the dtype')
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float16 if self.fp16.enabled else torch.float32


# ---- load-time rules between values ---------------------------------------------------------------------------

_MISSING = object()


def static_problems(config: ZeroConfig) -> list[str]:
    """Every load-time rule between values (no runtime facts needed); run by `ZeroConfig.from_any`."""
    return [
        *_refused_problems(config),
        *_precision_problems(config),
        *_param_dtype_problems(config),
        *library_problems(
            {
                name: module
                for name, module in (("wandb", "wandb"), ("comet", "comet_ml"), ("tensorboard", "tensorboard"))
                if getattr(config, name).enabled is True
            }
        ),  # fmt: skip
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


def _param_dtype_problems(config: ZeroConfig) -> list[str]:
    """DeepSpeed 0.19.8's `_assert_valid_mixed_precision_config`: `data_types.param_dtype` names the enabled one."""
    wanted = config.data_types.param_dtype
    fp16, bf16 = config.fp16.enabled, config.bf16.enabled
    if wanted is None or is_auto(wanted) or is_auto(fp16) or is_auto(bf16):
        return []
    model = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    if wanted == model:
        return []
    return [
        f"data_types.param_dtype={wanted!r} conflicts with the enabled precision mode (model dtype {model}): set the "
        f"matching fp16/bf16 'enabled' flag or omit data_types.param_dtype"
    ]


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

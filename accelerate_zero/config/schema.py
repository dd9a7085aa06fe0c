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
one way: values <- fields <- blocks <- loading <- schema <- resolve.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

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
from accelerate_zero.config.compile_block import CompileConfig, compile_refusals
from accelerate_zero.config.loading import auto_keys, filled_autos, load_config
from accelerate_zero.config.values import AUTO, ZeroConfigError, is_auto, join_path


if TYPE_CHECKING:
    import torch


__all__ = [
    "AUTO",
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
    prescale_gradients: bool = False
    """Divide gradients by the world size before (instead of after) reduction."""
    gradient_predivide_factor: float = _f(1.0, gt=0)
    """Divide gradients by this before reduction and by world_size/factor after."""
    data_types: DataTypesConfig = _f(factory=DataTypesConfig)
    """Engine buffer dtypes."""
    checkpoint: CheckpointConfig = _f(factory=CheckpointConfig)
    """Checkpoint options."""
    dataloader_drop_last: bool = False
    """DeepSpeed's own dataloader option; `true` is refused."""
    aio: AioConfig = _f(factory=AioConfig)
    """Asynchronous file IO for NVMe offload."""
    activation_checkpointing: ActivationCheckpointingConfig = _f(factory=ActivationCheckpointingConfig)
    """DeepSpeed's activation checkpointing block: `cpu_checkpointing` keeps what backward needs in host memory."""
    expert_parallel: ExpertParallelConfig = _f(factory=ExpertParallelConfig)
    """DeepSpeed's AutoEP block: each MoE layer's experts split over `autoep_size` ranks (accelerate_zero/engine/experts)."""
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


class RefusedFeature(NamedTuple):
    """A DeepSpeed option accelerate_zero will never implement: only `default` (or what `accepts` allows) passes."""

    default: Any
    reason: str
    accepts: Callable[[Any], bool] | None = None


_NOT_IMPLEMENTED = "is a DeepSpeed feature accelerate_zero does not implement"
_FP32_MASTER = "accelerate_zero always keeps fp32 master weights, gradients and optimizer states"
_NO_PATCH = "accelerate_zero never patches nn.Module"

_OWN_ROUTER = "the router, its top-k and scores stay the model's (set them in the model's config)"
_OWN_EXPERTS = "the model's own experts module runs on each rank's experts (transformers' experts_implementation)"
_BY_STRUCTURE = "MoE layers are found by structure (fused 3-D expert parameters), not by name patterns"


def _expert_parallel_refusals() -> dict[str, RefusedFeature]:
    """`expert_parallel` keys that configure DeepSpeed's AutoEP modules rather than the split itself."""

    def auto(value: Any) -> bool:
        return value is None or value == "auto"

    reasons = {
        "expert_tensor_parallel_size": (1, "accelerate_zero has no tensor parallelism"),
        "validate_folding_routing": (
            False,
            "it checks AutoEP+AutoTP folding; accelerate_zero has no tensor parallelism",
        ),
        "async_split_plan": (False, "it overlaps DeepSpeed's own split planning; " + _OWN_EXPERTS),
        "moe_layer_pattern": (None, _BY_STRUCTURE),
        "expert_pattern": (None, _BY_STRUCTURE),
        "router_pattern": (None, _BY_STRUCTURE),
        "use_grouped_mm": (True, _OWN_EXPERTS),
        "route_norm": (None, _OWN_ROUTER),
        "route_scale": (1.0, _OWN_ROUTER),
        "gate_up_impl": ("separate", _OWN_EXPERTS),
        "comm_backend": ("comm", "tokens travel with torch.distributed's all-to-all; DeepEP is not used"),
        "comm_num_sm": (12, "it sizes DeepEP, which is not used"),
        "comm_qp_margin": (4, "it sizes DeepEP, which is not used"),
        "comm_max_tokens_per_rank": (0, "it sizes DeepEP, which is not used"),
        "num_expert_groups": (None, _OWN_ROUTER),
        "num_limited_groups": (None, _OWN_ROUTER),
        "load_balance_coeff": (None, "the load-balancing loss stays the model's (router_aux_loss_coef)"),
        "expert_w1": (None, _BY_STRUCTURE),
        "expert_w2": (None, _BY_STRUCTURE),
        "expert_w3": (None, _BY_STRUCTURE),
        "num_experts_attr": (None, _BY_STRUCTURE),
        "top_k_attr": (None, _BY_STRUCTURE),
        "has_shared_experts": (None, _BY_STRUCTURE + "; shared experts stay dense, sharded like the rest"),
        "shared_experts_pattern": (None, _BY_STRUCTURE),
        "shared_experts_gate_pattern": (None, _BY_STRUCTURE),
        "expert_activation": (None, _OWN_EXPERTS),
    }
    refused = {f"expert_parallel.{key}": RefusedFeature(*value) for key, value in reasons.items()}
    for key, reason in (("score_apply", _OWN_ROUTER), ("combine_impl", _OWN_EXPERTS),
                        ("row_weighting_impl", _OWN_EXPERTS), ("score_func", _OWN_ROUTER), ("top_k", _OWN_ROUTER),
                        ("routed_scaling_factor", _OWN_ROUTER)):  # fmt: skip
        refused[f"expert_parallel.{key}"] = RefusedFeature("auto", reason, accepts=auto)
    return refused


REFUSED_FEATURES: dict[str, RefusedFeature] = {
    "zero_optimization.legacy_stage1": RefusedFeature(False, "DeepSpeed removed the legacy stage 1; use stage 1"),
    "zero_optimization.zero_quantized_nontrainable_weights": RefusedFeature(
        False, f"quantized storage of frozen weights {_NOT_IMPLEMENTED}"
    ),
    "zero_optimization.zeropp_loco_param": RefusedFeature(None, f"LoCo-ZeRO++ {_NOT_IMPLEMENTED}"),
    "zero_optimization.mics_hierarchical_params_gather": RefusedFeature(
        False,
        "MiCS's two-level gather for shard groups that span nodes is not implemented (mics_shard_size is: keep a "
        "shard group within a node, where the gather is one collective)",
    ),
    "zero_optimization.zenflow": RefusedFeature(
        None,
        f"ZenFlow {_NOT_IMPLEMENTED}: it applies most gradients asynchronously, steps late, so training departs from "
        "the exact step; offload_optimizer.device cpu runs the exact step",
    ),
    "zero_optimization.elastic_checkpoint": RefusedFeature(
        False, "DeepSpeed's legacy elastic checkpoints are not implemented (use universal checkpoints)"
    ),
    "zero_optimization.use_multi_rank_bucket_allreduce": RefusedFeature(
        True, "accelerate_zero reduces gradients with a real reduce-scatter"
    ),
    "zero_optimization.memory_efficient_linear": RefusedFeature(True, _NO_PATCH),
    "zero_optimization.override_module_apply": RefusedFeature(True, _NO_PATCH),
    "zero_optimization.offload_optimizer.super_offload": RefusedFeature(
        False,
        f"SuperOffload (DeepSpeed's stage 3 for Superchips: a speculative host step, GraceAdam) {_NOT_IMPLEMENTED}; "
        "offload_optimizer.device cpu steps on the rank's cores, cpuadam_cores_perc sets their share",
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
    # DeepSpeed reads the keys below only inside its own `deepspeed.checkpointing.checkpoint`; here the model's
    # gradient checkpointing (transformers' `gradient_checkpointing_enable`) checkpoints the layers.
    "activation_checkpointing.partition_activations": RefusedFeature(
        False,
        "it splits each checkpoint across tensor-model-parallel ranks and accelerate_zero has no tensor "
        "parallelism; Ulysses (sequence_parallel_size) already splits every activation along the sequence, and "
        "cpu_checkpointing moves the checkpoints to host memory",
    ),
    "activation_checkpointing.contiguous_memory_optimization": RefusedFeature(
        False, "DeepSpeed allows it only with partition_activations, which is refused"
    ),
    "activation_checkpointing.number_checkpoints": RefusedFeature(
        None, "it only sizes contiguous_memory_optimization's buffer, which is refused"
    ),
    "activation_checkpointing.synchronize_checkpoint_boundary": RefusedFeature(
        False,
        "it synchronizes the device around each layer of DeepSpeed's own checkpoint function, which accelerate_zero "
        "does not run; to serialize CUDA work while debugging, run with CUDA_LAUNCH_BLOCKING=1",
    ),
    "activation_checkpointing.profile": RefusedFeature(
        False,
        "it times each layer of DeepSpeed's own checkpoint function, which accelerate_zero does not run; use "
        "wall_clock_breakdown or torch.profiler",
    ),
    **_expert_parallel_refusals(),
    **{path: RefusedFeature(default, reason) for path, (default, reason) in compile_refusals().items()},
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

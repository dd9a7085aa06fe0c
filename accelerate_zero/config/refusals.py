"""`REFUSED_FEATURES`: DeepSpeed options `ZeroConfig.from_any` refuses by name when a config sets them to anything
but the value accelerate_zero runs, each with its reason (the rest of [Note: DeepSpeed's config rule] is in
config/deepspeed_keys.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from accelerate_zero.config.compile_block import compile_refusals


class RefusedFeature(NamedTuple):
    """A DeepSpeed option accelerate_zero will never implement: only `default` (or what `accepts` allows) passes."""

    default: Any
    reason: str
    accepts: Callable[[Any], bool] | None = None


_NOT_IMPLEMENTED = "is a DeepSpeed feature accelerate_zero does not implement"
_FP32_MASTER = "accelerate_zero always keeps fp32 master weights, gradients and optimizer states"


def _not_built_yet() -> dict[str, RefusedFeature]:
    """DeepSpeed options this version has not built (they may come); before issue 48 the engine refused them at
    `initialize` only, so `accelerate-zero validate` accepted what the run then refused."""
    return {
        "zero_optimization.stage3_allgather_sequential": RefusedFeature(False, "units are always gathered flat"),
        "zero_optimization.stage3_module_granularity_threshold": RefusedFeature(
            0, "not available; choose the gather units with initialize(unit_classes=...) or leaf_module"
        ),
        "zero_optimization.pipeline_loading_checkpoint": RefusedFeature(
            False, "partitioned loading is not available yet"
        ),
        "zero_optimization.offload_optimizer.ratio": RefusedFeature(
            1.0,
            "partial offload (part of the optimizer step on the device) is not available, since memory accounting "
            "and offload_states would take those device masters for host ones; remove the key to offload all of it, "
            "or remove offload_optimizer",
        ),
        "zero_optimization.load_from_fp32_weights": RefusedFeature(
            True, "accelerate_zero checkpoints always restore the fp32 master weights"
        ),
        "checkpoint.use_node_local_storage": RefusedFeature(False, "not available (every rank writes its own files)"),
        "checkpoint.parallel_write": RefusedFeature(
            {"pipeline_stage": False}, "pipeline-stage parallel writing is not available (no pipeline parallelism)"
        ),
    }


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
    "data_types.buffer_dtype": RefusedFeature(
        None, "casting the model's buffers is not built: they keep the dtype they were loaded in"
    ),
    "data_types.keep_in_fp32_modules": RefusedFeature(
        None,
        "it only names buffers to keep in fp32 when data_types.buffer_dtype casts them, which is not built",
        accepts=lambda value: value is None or value == "auto",
    ),
    **_not_built_yet(),
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

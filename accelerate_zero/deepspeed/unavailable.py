"""What DeepSpeed 0.19.8 offers that accelerate_zero does not, each with what to use instead.

A script that reaches one of these gets `DeepSpeedUnavailable` naming it, at the call, on every rank (every rank
runs the same script), never a bare AttributeError. `DeepSpeedUnavailable` is an AttributeError, so `hasattr()`
probes still answer False, and a NotImplementedError.
"""

from __future__ import annotations


class DeepSpeedUnavailable(AttributeError, NotImplementedError):
    """A DeepSpeed API this package does not implement; the message says what to use instead."""


_MODULE_HINTS = {
    "PipelineModule": "pipeline parallelism is not available: train the whole model on every rank with ZeRO "
    "(stage 3 shards it) and sequence_parallel_size for long sequences",
    "PipelineEngine": "pipeline parallelism is not available (see PipelineModule)",
    "DualPipeVEngine": "pipeline parallelism is not available (see PipelineModule)",
    "DualPipeVModule": "pipeline parallelism is not available (see PipelineModule)",
    "pipe": "pipeline parallelism is not available (see PipelineModule)",
    "init_inference": "DeepSpeed-Inference (kernel injection, tensor-parallel inference) is not available: run the "
    "model itself (under stage 3, engine.module with every rank calling generate) or a serving engine such as vLLM",
    "InferenceEngine": "DeepSpeed-Inference is not available (see init_inference)",
    "DeepSpeedInferenceConfig": "DeepSpeed-Inference is not available (see init_inference)",
    "default_inference_config": "DeepSpeed-Inference is not available (see init_inference)",
    "DeepSpeedHybridEngine": "the hybrid engine (hybrid_engine.enabled) is not available: generate with the training "
    "engine's module, or a separate inference engine fed with engine.named_full_parameters()",
    "tp_model_init": "tensor parallelism (AutoTP) is not available: ZeRO stage 3 shards every parameter instead",
    "set_autotp_mode": "tensor parallelism (AutoTP) is not available (see tp_model_init)",
    "merge_tp_model_init_into_config": "tensor parallelism (AutoTP) is not available (see tp_model_init)",
    "record_tp_model_init_args": "tensor parallelism (AutoTP) is not available (see tp_model_init)",
    "replace_transformer_layer": "kernel injection is not available: the model's own modules run",
    "module_inject": "kernel injection is not available: the model's own modules run",
    "DeepSpeedTransformerLayer": "DeepSpeed's fused transformer kernels are not available: use the model's own layers",
    "DeepSpeedTransformerConfig": "DeepSpeed's fused transformer kernels are not available",
    "DeepSpeedConfig": "DeepSpeed's config class is not available: pass the config dict or path to initialize (it is "
    "read by accelerate_zero.ZeroConfig.from_any, which checks every key)",
    "load_ds_config": "use accelerate_zero.ZeroConfig.from_any(path_or_dict)",
    "DeepSpeedOptimizer": "DeepSpeed's optimizer wrappers are not available: the engine wraps any torch optimizer; "
    "engine.optimizer is the optimizer you passed (or the one the config's optimizer block built)",
    "checkpointing": "deepspeed.checkpointing (DeepSpeed's activation checkpointing API) is not available: use "
    "torch.utils.checkpoint.checkpoint or model.gradient_checkpointing_enable(); the config's "
    "activation_checkpointing.cpu_checkpointing moves the checkpoints to host memory",
    "OnDevice": "OnDevice is not available: build on the meta device with `with torch.device('meta'):`, or partition "
    "while building with accelerate_zero.deepspeed.zero.Init",
    "moe": "DeepSpeed's MoE layers are not available: keep the model's own MoE blocks and set the config's "
    "expert_parallel block",
    "sequence": "deepspeed.sequence (DistributedAttention) is not available: set sequence_parallel_size in the config "
    "(Ulysses through accelerate_zero.sequence)",
    "profiling": "deepspeed.profiling (its FlopsProfiler class) is not available: the config's flops_profiler block "
    "profiles step `profile_step` (torch.utils.flop_counter)",
    "monitor": "deepspeed.monitor (its MonitorMaster class) is not available: the config's tensorboard, csv_monitor, "
    "wandb and comet blocks write the engine's events, and engine.monitor.write_events writes your own",
    "compression": "DeepSpeed Compression is not available",
    "autotuning": "the autotuner is not available: `accelerate-zero estimate` sizes memory for a config",
    "elasticity": "elastic training is not available: checkpoints load at any world size instead",
    "inference": "DeepSpeed-Inference is not available (see init_inference)",
    "linear": "deepspeed.linear (LoRA/quantized linear layers) is not available: use peft",
    "runtime": "deepspeed.runtime internals are not available: use the public API (initialize, zero, comm)",
    "utils": "deepspeed.utils is not available: use the engine's methods and accelerate_zero.debug",
    "set_optimizer_flags": "Muon parameter flags are set by the engine itself",
    **{
        name: "DeepSpeed's per-head Muon tags are not available: the engine's Muon steps whole matrices"
        for name in ("QUERY", "KV", "MLA_Q", "MLA_KV", "NOT_HEAD_BLOCKED")
    },
    "resolve_per_head_muon_after_sharding": "Muon parameter flags are set by the engine itself",
}

_ENGINE_HINTS = {
    "flops_profiler": "the engine's FlopsProfiler object is not available: the config's flops_profiler block "
    "profiles step `profile_step` and prints DeepSpeed's summary",
    "timers": "DeepSpeed's timers are not available: wall_clock_breakdown logs the phases (or use torch.profiler)",
    "tput_timer": "DeepSpeed's throughput timer is not available",
    "mpu": "model parallelism (mpu) is not available",
    "allreduce_gradients": "gradients are reduced by backward() and step() themselves",
    "set_train_batch_size": "the batch size is fixed by the config: change train_batch_size there",
    "set_train_micro_batch_size": "the batch size is fixed by the config: change train_micro_batch_size_per_gpu there",
    "random_ltd_initialize": "random-LTD (data efficiency) is not available",
    "set_custom_curriculum_learning_schedule": "curriculum learning (data efficiency) is not available",
    "set_data_post_process_func": "curriculum learning (data efficiency) is not available",
    "scale": "engine.scale(loss) with a manual loss.backward() is not available: call engine.backward(loss)",
    "load_moe_state_dict": "DeepSpeed's MoE layers are not available",
    "print_forward_breakdown": "use torch.profiler",
    "get_wall_clock_timers": "use torch.profiler",
}

# The rest of DeepSpeedEngine's public methods (0.19.8) that this engine does not have; each is refused with its
# name. Methods the model has are reached first (DeepSpeed's pass-through), so a model's own `compile`, say, wins.
_ENGINE_METHODS = frozenset(
    """
    active_registration_count active_timers aio_config all_gather_scalar allreduce_and_copy allreduce_bucket
    allreduce_no_retain autotp_size autotuning_enabled autotuning_end_profile_step autotuning_metric
    autotuning_metric_path autotuning_model_info_path autotuning_profile_model_info autotuning_start_profile_step
    bf16_master_weights_and_gradients bf16_optimizer_states buffered_allreduce_fallback
    checkpoint_serialization_enabled checkpoint_tag_validation_enabled checkpoint_tag_validation_fail
    checkpoint_writer_enabled clip_fp32_gradients coalesce_grad_reduction collect_python_gc communication_data_type
    compile_autosp compile_autotp compile_zero_optimization_stage cpuadam_cores_perc curriculum_learning_config
    curriculum_learning_enabled data_efficiency_config data_efficiency_enabled data_sampling_config
    data_sampling_enabled dataloader_drop_last dump_state dynamic_loss_scale dynamic_loss_scale_args
    flops_profiler_detailed flops_profiler_enabled flops_profiler_module_depth flops_profiler_output_file
    flops_profiler_profile_step flops_profiler_recompute_fwd_factor flops_profiler_top_modules fp16_auto_cast
    fp16_master_weights_and_gradients get_autosp_backend get_autotp_backend get_compile_time get_data_types
    get_deepcompile_backend get_deepspeed_compile_backend get_model_parallel_rank get_optimizer_configuration
    get_sequence_parallel_group get_tensor_parallel_rank get_type gradient_predivide_factor initial_dynamic_scale
    is_compiled is_current_graph_registered is_deepcompile_active is_deepcompile_enabled
    is_first_weights_partition_group is_iterable_style_dataset is_map_style_dataset is_sanity_checks_enabled
    load_module_state_dict load_universal_checkpoint log_level managed_gradient_accumulation new_state
    optimizer_legacy_fusion optimizer_params postscale_gradients random_ltd_config random_ltd_enabled
    register_compile_pass register_current_graph scheduler_name scheduler_params sparse_all_gather sparse_allreduce
    sparse_allreduce_bucket sparse_allreduce_no_retain super_offload supported swap_tensor_config
    tensor_parallel_config torch_autocast_dtype torch_autocast_enabled torch_autocast_lower_precision_safe_modules
    unregister use_node_local_storage uses_parallelization_pass_only zenflow_config zero_allgather_bucket_size
    zero_allgather_partitions zero_allgather_sequential zero_allow_untested_optimizer zero_compute_grad_norm
    zero_contiguous_gradients zero_elastic_checkpoint zero_force_ds_cpu_optimizer
    zero_gather_16bit_weights_on_model_save zero_hpz_partition_size zero_ignore_unused_parameters zero_legacy_stage1
    zero_load_from_fp32_weights zero_log_trace_cache_warnings zero_max_live_parameters zero_max_reuse_distance
    zero_model_persistence_threshold zero_module_granularity_threshold zero_multi_rank_bucket_allreduce
    zero_nvme_offload_optimizer zero_overlap_comm zero_param_persistence_threshold zero_parameter_alignment
    zero_partial_offload zero_prefetch_bucket_size zero_quantized_gradients zero_quantized_nontrainable_weights
    zero_quantized_weights zero_reduce_bucket_size zero_reduce_scatter zero_round_robin_gradients
    zero_save_muon_momentum_buffer_in_memory zero_sub_group_size zero_use_cpu_optimizer
    """.split()
)


def module_refusal(name: str) -> str | None:
    """The message for `deepspeed.<name>` if DeepSpeed has it and we do not; None for a name DeepSpeed lacks too."""
    hint = _MODULE_HINTS.get(name)
    return None if hint is None else f"deepspeed.{name} is not available in accelerate_zero.deepspeed: {hint}"


def engine_refusal(name: str) -> str | None:
    """The message for `engine.<name>` if DeepSpeed's engine has it and ours does not; None otherwise."""
    if name in _ENGINE_HINTS:
        return f"DeepSpeedEngine.{name} is not available in accelerate_zero: {_ENGINE_HINTS[name]}"
    if name in _ENGINE_METHODS:
        return (
            f"DeepSpeedEngine.{name} is not available in accelerate_zero: read the setting from engine.config "
            "(the resolved config) or see the engine's methods (help(engine))"
        )
    return None

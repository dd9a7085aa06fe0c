"""ZeroConfig.from_any errors: unknown keys, several problems at once, refused DeepSpeed features."""

from __future__ import annotations

import pytest

from accelerate_zero.config import ZeroConfig, ZeroConfigError
from accelerate_zero.config.schema import REFUSED_FEATURES


def problems_of(raw: object) -> list[str]:
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig.from_any(raw)
    return info.value.problems


# ---- errors ------------------------------------------------------------------------------------------------------


def test_unknown_keys_are_sorted_with_suggestions() -> None:
    """In the blocks DeepSpeed validates strictly (pydantic models) an unknown key is an error, as there; at the top
    level DeepSpeed never reads an unknown key, so it is accepted and named in a note ([Note: DeepSpeed's config
    rule] in config/deepspeed_keys.py)."""
    raw = {
        "zero_optimization": {"reduce_bucket_sz": 1, "offload_param": {"pin_memroy": True}},
        "trian_batch_size": 8,
        "fp16": {"xyz": 1},
        "tensorboard": {"enabled": False, "output_pth": "x"},
    }
    assert problems_of(raw) == [
        "unknown key 'fp16.xyz': remove it or fix its spelling",
        "unknown key 'tensorboard.output_pth' (did you mean 'output_path'?): remove it or fix its spelling",
        "unknown key 'zero_optimization.offload_param.pin_memroy' (did you mean 'pin_memory'?): remove it or fix "
        "its spelling",
        "unknown key 'zero_optimization.reduce_bucket_sz' (did you mean 'reduce_bucket_size'?): remove it or fix "
        "its spelling",
    ]
    del raw["fp16"], raw["zero_optimization"], raw["tensorboard"]
    assert ZeroConfig.from_any(raw).notes == (
        "'trian_batch_size' is not a key DeepSpeed reads: accepted and ignored (DeepSpeed ignores it too; did you "
        "mean 'train_batch_size'?)",
    )


def test_several_problems_are_reported_together() -> None:
    raw = {
        "zero_optimization": {"stage": 4, "reduce_bucket_size": -1, "offload_optimizer": {"ratio": 1.5}},
        "gradient_clipping": "x",
        "fp16": {"enabled": True},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}},
        "scheduler": {"params": {}},
    }
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig.from_any(raw)
    assert info.value.problems == [
        "zero_optimization.stage=4: expected an integer in [0, 3]",
        "zero_optimization.reduce_bucket_size=-1: expected an integer >= 0",
        "zero_optimization.offload_optimizer.ratio=1.5: expected a finite number in [0, 1]",
        "gradient_clipping='x': expected a finite number >= 0",
        'scheduler.type is missing: name the LR scheduler, e.g. "type": "WarmupLR"',
        "fp16.enabled and bf16.enabled are both true: bfloat16 and fp16 modes cannot be simultaneously enabled; "
        "set one of them to false",
        "optimizer.params.max_grad_norm: 'max_grad_norm' is not supported as an optimizer parameter, please switch "
        "to using the top-level parameter 'gradient_clipping'",
    ]
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith("invalid ZeRO config (7 problems):\n- zero_optimization.stage=4")


def test_non_mapping_blocks_and_sources_are_errors() -> None:
    assert problems_of({"fp16": None, "zero_optimization": [1]}) == [
        "fp16=None: expected a mapping of keys to values",
        "zero_optimization=[1]: expected a mapping of keys to values",
    ]
    assert problems_of(["not", "a", "dict"]) == ["a ZeRO config must be a mapping of keys to values, got list"]


REFUSED_SAMPLES = {
    "zero_optimization.legacy_stage1": True,
    "zero_optimization.zero_quantized_nontrainable_weights": True,
    "zero_optimization.zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024},
    "zero_optimization.mics_hierarchical_params_gather": True,
    "zero_optimization.zenflow": {"topk_ratio": 0.1},
    "zero_optimization.elastic_checkpoint": True,
    "zero_optimization.use_multi_rank_bucket_allreduce": False,
    "zero_optimization.offload_optimizer.super_offload": True,
    "fp16.fp16_master_weights_and_grads": True,
    "bf16.bf16_master_weights_and_grads": True,
    "bf16.bf16_optimizer_states": True,
    "bf16.immediate_grad_update": False,
    "data_types.buffer_dtype": "bf16",
    "data_types.keep_in_fp32_modules": ["norm"],
    "zero_optimization.stage3_allgather_sequential": True,
    "zero_optimization.stage3_module_granularity_threshold": 16,
    "zero_optimization.pipeline_loading_checkpoint": True,
    "zero_optimization.offload_optimizer.ratio": 0.3,
    "zero_optimization.load_from_fp32_weights": False,
    "checkpoint.use_node_local_storage": True,
    "checkpoint.parallel_write": {"pipeline_stage": True},
    "activation_checkpointing.partition_activations": True,
    "activation_checkpointing.contiguous_memory_optimization": True,
    "activation_checkpointing.number_checkpoints": 24,
    "activation_checkpointing.synchronize_checkpoint_boundary": True,
    "activation_checkpointing.profile": True,
    **{
        f"expert_parallel.{key}": value
        for key, value in {
            "expert_tensor_parallel_size": 2,
            "validate_folding_routing": True,
            "async_split_plan": True,
            "moe_layer_pattern": "layers.*.mlp",
            "expert_pattern": "experts",
            "router_pattern": "gate",
            "use_grouped_mm": False,
            "route_norm": True,
            "route_scale": 2.0,
            "score_apply": "pre",
            "combine_impl": "legacy_bmm",
            "row_weighting_impl": "fused",
            "gate_up_impl": "fused",
            "comm_backend": "deepep",
            "comm_num_sm": 24,
            "comm_qp_margin": 8,
            "comm_max_tokens_per_rank": 4096,
            "num_expert_groups": 8,
            "num_limited_groups": 4,
            "score_func": "sigmoid",
            "top_k": 4,
            "load_balance_coeff": 0.01,
            "routed_scaling_factor": 2.5,
            "expert_w1": "w1",
            "expert_w2": "w2",
            "expert_w3": "w3",
            "num_experts_attr": "num_experts",
            "top_k_attr": "top_k",
            "has_shared_experts": True,
            "shared_experts_pattern": "shared_expert",
            "shared_experts_gate_pattern": "shared_expert_gate",
            "expert_activation": "gelu",
        }.items()
    },  # DeepSpeed 0.19.8's AutoEP keys other than enabled / autoep_size / preset_model
    **{
        f"compile.{key}": value
        for key, value in {
            "deepcompile": True,
            "autoep_non_moe": True,
            "free_activation": True,
            "free_activation_threshold": 1024,
            "offload_activation": True,
            "offload_activation_pin_memory": False,
            "offload_opt_states": True,
            "double_buffer": False,
            "symmetric_memory": True,
            "debug_log": True,
            "offload_parameters": True,
            "sync_before_reduce": True,
            "sync_after_reduce": True,
            "sync_before_allgather": True,
            "sync_after_allgather": True,
            "keep_int_input_tensors": False,
            "keep_all_input_tensors": True,
            "passes": ["z3"],
        }.items()
    },  # DeepSpeed 0.19.8's DeepCompile keys (config/compile_block.py)
}


def _nested(path: str, value: object) -> dict:
    *parents, leaf = path.split(".")
    raw: dict = {leaf: value}
    for name in reversed(parents):
        raw = {name: raw}
    return raw


def test_every_refused_feature_has_a_sample() -> None:
    assert set(REFUSED_SAMPLES) == set(REFUSED_FEATURES)


@pytest.mark.parametrize("path", sorted(REFUSED_SAMPLES))
def test_refused_feature_is_named_with_its_reason(path: str) -> None:
    value = REFUSED_SAMPLES[path]
    problems = problems_of(_nested(path, value))
    assert len(problems) == 1
    assert problems[0].startswith(f"{path}={value!r} is not supported ({REFUSED_FEATURES[path].reason})")
    ZeroConfig.from_any(_nested(path, REFUSED_FEATURES[path].default))  # the accepted value loads


def test_refused_feature_messages_for_the_named_reasons() -> None:
    problems = problems_of({"bf16": {"bf16_optimizer_states": True}, "data_types": {"buffer_dtype": "fp16"}})
    assert problems == [
        "bf16.bf16_optimizer_states=True is not supported (accelerate_zero always keeps fp32 master weights, "
        "gradients and optimizer states): remove the key or set it to false",
        "data_types.buffer_dtype='fp16' is not supported (casting the model's buffers is not built: they keep the "
        "dtype they were loaded in): remove the key or set it to null",
    ]


def test_keys_that_describe_what_accelerate_zero_does_load_either_way() -> None:
    """`memory_efficient_linear` / `override_module_apply` false ask DeepSpeed not to patch torch (we never do);
    `dataloader_drop_last` only touches the dataloader DeepSpeed builds from training_data (initialize takes none):
    DeepSpeed-Chat and Megatron-DeepSpeed write them."""
    for value in (False, True):
        zero = {"memory_efficient_linear": value, "override_module_apply": value}
        config = ZeroConfig.from_any({"zero_optimization": zero, "dataloader_drop_last": value})
        assert config.zero_optimization.memory_efficient_linear is value
        assert config.dataloader_drop_last is value


def test_harmless_values_of_refused_numeric_features_load() -> None:
    zero = ZeroConfig.from_any({"zero_optimization": {"zero_hpz_partition_size": 0, "mics_shard_size": 0}})
    assert (zero.zero_optimization.zero_hpz_partition_size, zero.zero_optimization.mics_shard_size) == (0, 0)


def test_dynamic_loss_scale_needs_positive_window() -> None:
    assert problems_of({"fp16": {"enabled": True, "loss_scale_window": 0}}) == [
        "fp16.loss_scale_window=0: must be > 0 when dynamic loss scaling is enabled (loss_scale=0)"
    ]
    ZeroConfig.from_any({"fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 0}})  # static: unused


def test_activation_checkpointing_block_loads_its_defaults_and_cpu_checkpointing() -> None:
    # The block as DeepSpeed's docs and transformers' examples write it: every default, cpu_checkpointing on.
    block = {
        "partition_activations": False,
        "cpu_checkpointing": True,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }
    config = ZeroConfig.from_any({"activation_checkpointing": block})
    assert config.activation_checkpointing.cpu_checkpointing is True
    assert config.to_dict()["activation_checkpointing"] == block
    assert ZeroConfig.from_any({}).activation_checkpointing.cpu_checkpointing is False


def test_activation_checkpointing_bad_keys_are_named() -> None:
    problems = problems_of(
        {"activation_checkpointing": {"cpu_checkpoint": True, "cpu_checkpointing": "yes", "number_checkpoints": 0}}
    )
    assert problems == [
        "activation_checkpointing.cpu_checkpointing='yes': expected true or false",
        "activation_checkpointing.number_checkpoints=0: expected an integer >= 1 or null",
    ]
    # DeepSpeed reads this block key by key: a key it does not know is ignored there too, named in a note here.
    noted = ZeroConfig.from_any({"activation_checkpointing": {"cpu_checkpoint": True}}).notes
    assert noted == (
        "'activation_checkpointing.cpu_checkpoint' is not a key DeepSpeed reads: accepted and ignored (DeepSpeed "
        "ignores it too; did you mean 'cpu_checkpointing'?)",
    )
    problems = problems_of({"activation_checkpointing": {"partition_activations": True}})
    assert problems == [
        "activation_checkpointing.partition_activations=True is not supported (it splits each checkpoint across "
        "tensor-model-parallel ranks and accelerate_zero has no tensor parallelism; Ulysses (sequence_parallel_size) "
        "already splits every activation along the sequence, and cpu_checkpointing moves the checkpoints to host "
        "memory): remove the key or set it to false"
    ]

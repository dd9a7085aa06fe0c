"""Loading DeepSpeed-format configs into ZeroConfig: reference files, defaults, aliases, errors, round trips."""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from accelerate_zero.config import AUTO, ZeroConfig, ZeroConfigError, resolve_config


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# transformers' tests/deepspeed configs, unchanged (tests/fixtures/README.md); the only copy the tests read.
ZERO2_JSON = (FIXTURES / "ds_config_zero2.json").read_text()
ZERO3_JSON = (FIXTURES / "ds_config_zero3.json").read_text()
# sha256 of the files as transformers ships them: an edited fixture would silently test a different config.
FIXTURE_SHA256 = {
    "ds_config_zero2.json": "881c07e6b7ad2cd162cc2dd1c3daf33f89f3c31107fc5fe5880400b606ccea76",
    "ds_config_zero3.json": "f30cd4a76d232c4e27f40fbfd412d313258ff389041727d1f8f55dfa08fb9ffe",
}
ZERO2_AUTO_KEYS = [
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "fp16.enabled",
    "bf16.enabled",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_num_steps",
]


def problems_of(raw: object) -> list[str]:
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig.from_any(raw)
    return info.value.problems


# ---- reference configs -------------------------------------------------------------------------------------------


def test_fixtures_are_transformers_files_unchanged() -> None:
    for name, digest in FIXTURE_SHA256.items():
        assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == digest, name


def test_zero2_reference_loads_unchanged_and_reports_its_auto_keys(tmp_path: Path) -> None:
    (tmp_path / "ds_config_zero2.json").write_text(ZERO2_JSON)
    cfg = ZeroConfig.from_any(tmp_path / "ds_config_zero2.json")
    assert cfg.zero_optimization.stage == 2
    assert cfg.zero_optimization.allgather_bucket_size == 200_000_000  # JSON 200000000.0
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)
    assert cfg.zero_optimization.offload_optimizer is not None
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.overlap_comm is True
    assert cfg.optimizer is not None and cfg.optimizer.type == "AdamW"
    assert cfg.steps_per_print == 2000
    assert cfg.auto_keys() == ZERO2_AUTO_KEYS


def test_zero3_reference_loads_unchanged_with_the_legacy_gather_key(tmp_path: Path) -> None:
    (tmp_path / "ds_config_zero3.json").write_text(ZERO3_JSON)
    with pytest.warns(FutureWarning, match="stage3_gather_fp16_weights_on_model_save is deprecated"):
        cfg = ZeroConfig.from_any(str(tmp_path / "ds_config_zero3.json"))
    zero = cfg.zero_optimization
    assert zero.stage == 3
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert zero.sub_group_size == 100_000_000_000_000
    assert zero.stage3_max_live_parameters == 1_000_000_000
    assert zero.offload_param is not None and zero.offload_param.device == "cpu"
    assert cfg.fp16.enabled is True and cfg.fp16.initial_scale_power == 16
    assert cfg.optimizer is not None and cfg.optimizer.params["betas"] == [0.8, 0.999]
    assert cfg.auto_keys() == []


# ---- defaults (DeepSpeed 0.19.6) ---------------------------------------------------------------------------------


def test_defaults_mirror_deepspeed_0_19() -> None:
    cfg = ZeroConfig.from_any({})
    assert cfg.gradient_clipping == 1.0
    assert cfg.train_batch_size is None and cfg.gradient_accumulation_steps is None
    assert cfg.steps_per_print is None
    assert cfg.zero_force_ds_cpu_optimizer is True
    zero = cfg.zero_optimization
    # reduce_bucket_size: a deliberate difference ([Note: gradient reduction overlaps backward by default]).
    assert (zero.stage, zero.reduce_bucket_size, zero.allgather_bucket_size) == (0, 50_000_000, 500_000_000)
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_model_persistence_threshold == sys.maxsize
    assert zero.sub_group_size == 1_000_000_000
    assert zero.overlap_comm is None and zero.offload_param is None and zero.offload_optimizer is None
    assert zero.mics_shard_size == -1
    assert cfg.fp16.loss_scale == 0 and cfg.fp16.loss_scale_window == 1000 and cfg.fp16.hysteresis == 2
    assert cfg.bf16.immediate_grad_update is True and cfg.bf16.check_grad_overflow is True
    assert cfg.bf16.check_overflow is True
    assert cfg.checkpoint.tag_validation == "WARN"
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.overlap_events) == (1_048_576, 8, True)


def test_offload_defaults_mirror_deepspeed_0_19() -> None:
    cfg = ZeroConfig.from_any({"zero_optimization": {"stage": 3, "offload_optimizer": {}, "offload_param": {}}})
    optimizer, param = cfg.zero_optimization.offload_optimizer, cfg.zero_optimization.offload_param
    assert optimizer is not None and param is not None
    assert (optimizer.device, optimizer.pin_memory, optimizer.buffer_count, optimizer.ratio) == ("none", True, 4, 1.0)
    assert (param.pin_memory, param.buffer_count, param.buffer_size, param.max_in_cpu) == (
        True,
        5,
        100_000_000,
        1_000_000_000,
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overlap_comm_is_on_at_every_stage_unless_the_config_says(stage: int) -> None:
    # DeepSpeed: on at stage 3 only ([Note: gradient reduction overlaps backward by default] in config/schema.py).
    cfg = resolve_config(ZeroConfig.from_any({"zero_optimization": {"stage": stage}}), world_size=1)
    assert cfg.zero_optimization.overlap_comm is True
    raw = {"zero_optimization": {"stage": stage, "overlap_comm": False}}
    assert resolve_config(ZeroConfig.from_any(raw), world_size=1).zero_optimization.overlap_comm is False


# ---- aliases, deprecated keys, numbers -----------------------------------------------------------------------------


def test_short_aliases_map_to_stage3_names() -> None:
    raw = {
        "zero_optimization": {
            "stage": 3,
            "prefetch_bucket_size": 11,
            "param_persistence_threshold": 12,
            "model_persistence_threshold": 13,
            "max_live_parameters": 14,
            "max_reuse_distance": 15,
            "gather_16bit_weights_on_model_save": True,
            "module_granularity_threshold": 0,
            "use_all_reduce_for_fetch_params": True,
        }
    }
    zero = ZeroConfig.from_any(raw).zero_optimization
    assert zero.stage3_prefetch_bucket_size == 11
    assert zero.stage3_param_persistence_threshold == 12
    assert zero.stage3_model_persistence_threshold == 13
    assert zero.stage3_max_live_parameters == 14
    assert zero.stage3_max_reuse_distance == 15
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert zero.stage3_use_all_reduce_for_fetch_params is True
    # A threshold other than 0 is refused (not built), under the long name the alias maps to.
    raw["zero_optimization"]["module_granularity_threshold"] = 16
    refused = r"zero_optimization\.stage3_module_granularity_threshold=16 is not supported"
    with pytest.raises(ZeroConfigError, match=refused):
        ZeroConfig.from_any(raw)


def test_alias_and_long_name_together_is_an_error() -> None:
    raw = {"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}}
    assert problems_of(raw) == [
        "zero_optimization.prefetch_bucket_size and zero_optimization.stage3_prefetch_bucket_size are the same "
        "setting: keep only 'stage3_prefetch_bucket_size'"
    ]


def test_block_aliases_bfloat16_check_overflow_and_thread_count() -> None:
    cfg = ZeroConfig.from_any({"bfloat16": {"enabled": True, "check_overflow": False}, "aio": {"thread_count": 4}})
    assert cfg.bf16.enabled is True
    assert cfg.bf16.check_grad_overflow is False
    assert cfg.aio.intra_op_parallelism == 4
    assert "bfloat16" not in cfg.to_dict()


def test_cpu_offload_keys_migrate_with_a_warning() -> None:
    deprecated = {"cpu_offload": True, "cpu_offload_param": True, "cpu_offload_use_pin_memory": False}
    raw = {"zero_optimization": {"stage": 3, **deprecated}}
    with pytest.warns(FutureWarning) as record:
        zero = ZeroConfig.from_any(raw).zero_optimization
    assert {str(w.message).split(" ")[0] for w in record} == {
        "zero_optimization.cpu_offload",
        "zero_optimization.cpu_offload_param",
        "zero_optimization.cpu_offload_use_pin_memory",
    }
    assert raw == {"zero_optimization": {"stage": 3, **deprecated}}  # the caller's dict is not modified
    assert zero.offload_optimizer is not None and zero.offload_param is not None
    assert (zero.offload_optimizer.device, zero.offload_optimizer.pin_memory) == ("cpu", False)
    assert (zero.offload_param.device, zero.offload_param.pin_memory) == ("cpu", False)


def test_cpu_offload_false_adds_no_offload_block() -> None:
    with pytest.warns(FutureWarning):
        zero = ZeroConfig.from_any({"zero_optimization": {"stage": 2, "cpu_offload": False}}).zero_optimization
    assert zero.offload_optimizer is None


def test_deprecated_key_and_its_replacement_together_is_an_error() -> None:
    raw = {"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}}
    with pytest.warns(FutureWarning):
        problems = problems_of(raw)
    assert problems == [
        "zero_optimization.cpu_offload (deprecated) and zero_optimization.offload_optimizer are both set: "
        "keep only 'offload_optimizer'"
    ]


@pytest.mark.parametrize(("value", "stage"), [(True, 1), (False, 0)])
def test_boolean_zero_optimization_is_the_old_format(value: bool, stage: int) -> None:
    with pytest.warns(FutureWarning, match="deprecated format"):
        assert ZeroConfig.from_any({"zero_optimization": value}).zero_optimization.stage == stage


def test_numbers_given_as_floats_and_strings_become_ints() -> None:
    raw = {
        "train_micro_batch_size_per_gpu": "4",
        "gradient_clipping": "0.5",
        "zero_optimization": {"reduce_bucket_size": "5e8", "allgather_bucket_size": 5e8, "sub_group_size": 1e9},
    }
    cfg = ZeroConfig.from_any(raw)
    zero = cfg.zero_optimization
    assert (zero.reduce_bucket_size, zero.allgather_bucket_size, zero.sub_group_size) == (
        500_000_000,
        500_000_000,
        1_000_000_000,
    )
    assert all(type(v) is int for v in (zero.reduce_bucket_size, zero.allgather_bucket_size, zero.sub_group_size))
    assert cfg.train_micro_batch_size_per_gpu == 4 and cfg.gradient_clipping == 0.5


def test_fractional_int_and_bool_as_int_are_rejected() -> None:
    problems = problems_of({"zero_optimization": {"reduce_bucket_size": 2.5, "stage": True}})
    assert problems == [
        "zero_optimization.reduce_bucket_size=2.5: expected an integer >= 0",
        "zero_optimization.stage=True: expected an integer in [0, 3]",
    ]


def test_enums_are_case_insensitive_where_deepspeed_is() -> None:
    cfg = ZeroConfig.from_any(
        {
            "checkpoint": {"tag_validation": "fail"},
            "communication_data_type": "BF16",
            "data_types": {"grad_accum_dtype": "FP32"},
        }
    )
    assert (cfg.checkpoint.tag_validation, cfg.communication_data_type) == ("FAIL", "bf16")
    assert cfg.data_types.grad_accum_dtype == "fp32"
    assert problems_of({"zero_optimization": {"offload_optimizer": {"device": "CPU"}}}) == [
        "zero_optimization.offload_optimizer.device='CPU': expected one of 'none', 'cpu', 'nvme'"
    ]


def test_steps_per_print_inf_from_accelerate_means_never() -> None:
    assert ZeroConfig.from_any({"steps_per_print": float("inf")}).steps_per_print is None


def test_optimizer_param_strings_become_numbers() -> None:
    cfg = ZeroConfig.from_any({"optimizer": {"type": "AdamW", "params": {"lr": "3e-5", "betas": ["0.9", 0.95]}}})
    assert cfg.optimizer is not None
    assert cfg.optimizer.params == {"lr": 3e-5, "betas": [0.9, 0.95]}


# ---- files -------------------------------------------------------------------------------------------------------


def test_yaml_file_with_the_same_structure(tmp_path: Path) -> None:
    path = tmp_path / "zero.yaml"
    path.write_text(
        "zero_optimization:\n  stage: 3\n  reduce_bucket_size: 5e8\n  stage3_prefetch_bucket_size: 4.5e7\n"
        "bf16:\n  enabled: true\noptimizer:\n  type: AdamW\n  params:\n    lr: 3e-5\n"
    )
    cfg = ZeroConfig.from_any(path)
    assert cfg.zero_optimization.stage == 3
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000  # PyYAML reads 5e8 as a string
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 45_000_000
    assert cfg.bf16.enabled is True
    assert cfg.optimizer is not None and cfg.optimizer.params["lr"] == 3e-5
    assert ZeroConfig.from_any(str(path)) == cfg


def test_yml_extension_and_json_path_equal_the_dict(tmp_path: Path) -> None:
    raw = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    (tmp_path / "c.yml").write_text(yaml.safe_dump(raw))
    expected = ZeroConfig.from_any(raw)
    assert ZeroConfig.from_any(tmp_path / "c.json") == expected
    assert ZeroConfig.from_any(tmp_path / "c.yml") == expected


def test_duplicate_keys_in_files_are_errors(tmp_path: Path) -> None:
    (tmp_path / "d.json").write_text('{"zero_optimization": {"stage": 2, "stage": 3}}')
    (tmp_path / "d.yaml").write_text("zero_optimization:\n  stage: 2\n  stage: 3\n")
    assert problems_of(tmp_path / "d.json") == [
        f"duplicate key 'stage' in '{tmp_path / 'd.json'}': keep only one (DeepSpeed rejects duplicate keys too)"
    ]
    assert problems_of(tmp_path / "d.yaml") == [
        f"duplicate key 'stage' (line 3) in '{tmp_path / 'd.yaml'}': keep only one (DeepSpeed rejects duplicate keys too)"
    ]


def test_unreadable_or_malformed_files_are_config_errors(tmp_path: Path) -> None:
    assert problems_of(tmp_path / "missing.json")[0].startswith(f"cannot read config file '{tmp_path}/missing.json'")
    (tmp_path / "bad.json").write_text("{")
    assert problems_of(tmp_path / "bad.json")[0].startswith(f"'{tmp_path / 'bad.json'}' is not valid JSON")
    assert problems_of(tmp_path / "config.toml") == [
        f"config file '{tmp_path / 'config.toml'}' must end in .json, .yaml or .yml (got '.toml')"
    ]


def test_from_any_on_a_config_returns_an_equal_copy() -> None:
    cfg = ZeroConfig.from_any({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    copy = ZeroConfig.from_any(cfg)
    assert copy == cfg and copy is not cfg
    assert copy.optimizer is not None and cfg.optimizer is not None
    assert copy.optimizer.params is not cfg.optimizer.params


# ---- to_dict, auto_keys, fill_auto, compute_dtype ----------------------------------------------------------------


def test_to_dict_round_trips_with_long_names() -> None:
    raw = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "prefetch_bucket_size": 7, "offload_param": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": AUTO}},
        "bf16": {"enabled": AUTO},
    }
    cfg = ZeroConfig.from_any(raw)
    out = cfg.to_dict()
    assert out["zero_optimization"]["stage3_prefetch_bucket_size"] == 7
    assert "prefetch_bucket_size" not in out["zero_optimization"]
    assert out["zero_optimization"]["offload_param"]["pin_memory"] is True
    assert out["gradient_clipping"] == 1.0 and out["bf16"]["enabled"] == AUTO
    assert json.loads(json.dumps(out)) == out
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the canonical form uses no deprecated key
        assert ZeroConfig.from_any(out) == cfg


def test_fill_auto_fills_only_auto_values_and_creates_no_blocks() -> None:
    cfg = ZeroConfig.from_any(
        {"gradient_clipping": AUTO, "fp16": {"enabled": False}, "optimizer": {"type": "AdamW", "params": {"lr": AUTO}}}
    )
    filled = cfg.fill_auto(
        {
            "gradient_clipping": 0.5,
            "fp16.enabled": True,
            "optimizer.params.lr": 1e-4,
            "scheduler.params.warmup_max_lr": 1,
        }
    )
    assert filled.gradient_clipping == 0.5
    assert filled.fp16.enabled is False  # not "auto": kept
    assert filled.optimizer is not None and filled.optimizer.params["lr"] == 1e-4
    assert filled.scheduler is None
    assert filled.auto_keys() == []
    assert cfg.gradient_clipping == AUTO  # the original is unchanged


def test_fill_auto_validates_the_filled_values() -> None:
    cfg = ZeroConfig.from_any({"zero_optimization": {"reduce_bucket_size": AUTO}})
    assert (
        cfg.fill_auto({"zero_optimization.reduce_bucket_size": "4e6"}).zero_optimization.reduce_bucket_size
        == 4_000_000
    )
    with pytest.raises(ZeroConfigError, match=r"zero_optimization.reduce_bucket_size=-5: expected an integer >= 0"):
        cfg.fill_auto({"zero_optimization.reduce_bucket_size": -5})


def test_compute_dtype() -> None:
    import torch

    assert ZeroConfig.from_any({}).compute_dtype == torch.float32
    assert ZeroConfig.from_any({"fp16": {"enabled": True}}).compute_dtype == torch.float16
    assert ZeroConfig.from_any({"bf16": {"enabled": True}}).compute_dtype == torch.bfloat16
    with pytest.raises(ValueError, match='bf16.enabled is "auto"'):
        _ = ZeroConfig.from_any({"bf16": {"enabled": AUTO}}).compute_dtype


def test_blocks_validate_when_built_in_code() -> None:
    from accelerate_zero.config.schema import OffloadOptimizerConfig

    assert OffloadOptimizerConfig(buffer_count="8").buffer_count == 8
    with pytest.raises(ZeroConfigError) as info:
        OffloadOptimizerConfig(device="disk", ratio=-1)
    assert info.value.problems == [
        "zero_optimization.offload_optimizer.device='disk': expected one of 'none', 'cpu', 'nvme'",
        "zero_optimization.offload_optimizer.ratio=-1: expected a finite number in [0, 1]",
    ]

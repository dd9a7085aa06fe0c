"""accelerate config + `accelerate launch` flags -> DeepSpeed JSON + environment (no process is started)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from accelerate_zero.config import ZeroConfigError
from accelerate_zero.integrations.accelerate.launch_config import (
    CONFIG_ENV,
    MOE_ENV,
    build_deepspeed_config,
    settings_from_accelerate,
)
from accelerate_zero.integrations.accelerate.launcher import LaunchError, PreparedLaunch, prepare_launch


REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "accelerate_configs"


pytestmark = pytest.mark.usefixtures("clean_launch_env")  # tests/unit/conftest.py


def build(block: dict[str, Any], **flags: Any) -> dict[str, Any]:
    """The DeepSpeed config of an accelerate `deepspeed_config` block and flags."""
    mixed_precision = flags.pop("config_mixed_precision", None)
    settings = settings_from_accelerate(block, flags, config_mixed_precision=mixed_precision, source="cfg.yaml")
    return build_deepspeed_config(settings).deepspeed_config


def problems(block: dict[str, Any], **flags: Any) -> list[str]:
    with pytest.raises(ZeroConfigError) as info:
        build(block, **flags)
    return info.value.problems


def parse(*argv: str) -> argparse.Namespace:
    from accelerate_zero.cli import launch

    parser = argparse.ArgumentParser()
    launch.register(parser.add_subparsers())
    return parser.parse_args(["launch", *argv, "train.py", "--lr", "1"])


def write_yaml(tmp_path: Path, block: dict[str, Any] | None = None, **top: Any) -> str:
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "mixed_precision": "no",
        "num_machines": 1,
        "num_processes": 2,
        **top,
    }
    if block is not None:
        config["deepspeed_config"] = block
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def write_json(tmp_path: Path, config: dict[str, Any], name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


# ---- generated config (no deepspeed_config_file) ------------------------------------------------------------------


def test_defaults_are_accelerates_deepspeed_plugin_defaults() -> None:
    assert build({}) == {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "none", "nvme_path": None},
            "offload_param": {"device": "none", "nvme_path": None},
            "stage3_gather_16bit_weights_on_model_save": False,
        },
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
    }


@pytest.mark.parametrize(
    ("key", "value", "path", "expected"),
    [
        ("zero_stage", 1, "zero_optimization.stage", 1),
        ("zero_stage", "3", "zero_optimization.stage", 3),
        ("gradient_accumulation_steps", 4, "gradient_accumulation_steps", 4),
        ("gradient_clipping", 0.5, "gradient_clipping", 0.5),
        ("gradient_clipping", 0.0, "gradient_clipping", 0.0),  # accelerate drops it; DeepSpeed 0.19 would clip at 1
        ("offload_optimizer_device", "cpu", "zero_optimization.offload_optimizer.device", "cpu"),
        ("offload_param_device", "none", "zero_optimization.offload_param.device", "none"),
        ("zero3_save_16bit_model", True, "zero_optimization.stage3_gather_16bit_weights_on_model_save", True),
        ("zero3_save_16bit_model", "true", "zero_optimization.stage3_gather_16bit_weights_on_model_save", True),
    ],
)
def test_each_accelerate_key_sets_its_deepspeed_key(key: str, value: Any, path: str, expected: Any) -> None:
    node: Any = build({key: value})
    for name in path.split("."):
        node = node[name]
    assert node == expected


def test_nvme_paths_are_kept_and_exported(tmp_path: Path) -> None:
    block = {
        "zero_stage": 3,
        "offload_optimizer_device": "nvme",
        "offload_optimizer_nvme_path": "/tmp/nvme/opt",
        "offload_param_device": "nvme",
        "offload_param_nvme_path": "/tmp/nvme/param",
    }
    prepared = prepare_launch(parse("--config_file", write_yaml(tmp_path, block)))
    zero = json.loads(prepared.env[CONFIG_ENV])["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": "/tmp/nvme/opt"}
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": "/tmp/nvme/param"}
    assert prepared.env["ACCELERATE_ZERO_OFFLOAD_OPTIMIZER_NVME_PATH"] == "/tmp/nvme/opt"
    assert prepared.env["ACCELERATE_ZERO_OFFLOAD_PARAM_NVME_PATH"] == "/tmp/nvme/param"


def test_nvme_device_without_path_is_an_error() -> None:
    [problem] = problems({"zero_stage": 3, "offload_optimizer_device": "nvme"})
    assert "deepspeed_config.offload_optimizer_device in cfg.yaml is 'nvme' but no NVMe folder is set" in problem
    assert "offload_optimizer_nvme_path" in problem


def test_nvme_path_is_ignored_without_an_nvme_device() -> None:
    zero = build({"offload_optimizer_device": "cpu", "offload_optimizer_nvme_path": "/nvme"})["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "nvme_path": None}  # as accelerate


def test_param_offload_below_stage_3_is_an_error() -> None:
    [problem] = problems({"zero_stage": 2, "offload_param_device": "cpu"})
    assert problem.startswith("deepspeed_config.offload_param_device in cfg.yaml='cpu' needs ZeRO stage 3")


def test_flags_override_the_accelerate_config() -> None:
    config = build(
        {"zero_stage": 2, "gradient_accumulation_steps": 1, "offload_optimizer_device": "cpu"},
        zero_stage=1,
        gradient_accumulation_steps=8,
        gradient_clipping=2.0,
        offload_optimizer_device="none",
        zero3_save_16bit_model="true",
    )
    assert config["zero_optimization"]["stage"] == 1
    assert config["gradient_accumulation_steps"] == 8
    assert config["gradient_clipping"] == 2.0
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "none"
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_bad_values_are_all_reported_with_their_source() -> None:
    assert problems({"zero_stage": 5, "offload_param_device": "gpu"}, gradient_accumulation_steps=0) == [
        "deepspeed_config.zero_stage in cfg.yaml=5: expected a ZeRO stage 0, 1, 2 or 3",
        "deepspeed_config.offload_param_device in cfg.yaml='gpu': expected one of 'none', 'cpu', 'nvme'",
        '--gradient_accumulation_steps=0: expected an integer >= 1 or "auto"',
    ]


# ---- DeepSpeed zero_optimization keys in the deepspeed_config block ------------------------------------------------


def test_zero_optimization_keys_in_the_block_are_honoured() -> None:
    zero = build(
        {
            "zero_stage": 2,
            "overlap_comm": True,
            "reduce_bucket_size": "5e7",
            "prefetch_bucket_size": 1000,  # an alias
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
        }
    )["zero_optimization"]
    assert zero["overlap_comm"] is True
    assert zero["reduce_bucket_size"] == "5e7"
    assert zero["prefetch_bucket_size"] == 1000
    assert zero["offload_optimizer"] == {"device": "cpu", "nvme_path": None, "pin_memory": False}


def test_stage_written_as_a_zero_optimization_key_sets_the_stage() -> None:
    assert build({"stage": 1})["zero_optimization"]["stage"] == 1
    assert build({"stage": 1}, zero_stage=3)["zero_optimization"]["stage"] == 3  # the flag wins


def test_the_same_setting_twice_is_an_error() -> None:
    assert problems({"zero_stage": 1, "stage": 2}) == [
        "deepspeed_config.stage and deepspeed_config.zero_stage in cfg.yaml are the same setting: keep only "
        "'zero_stage' in cfg.yaml"
    ]


def test_bad_zero_optimization_values_name_the_key() -> None:
    assert problems({"reduce_bucket_size": "lots", "offload_param": 5}) == [
        "zero_optimization.offload_param=5: expected a mapping of keys to values",
        "zero_optimization.reduce_bucket_size='lots': expected an integer >= 0",
    ]


def test_unknown_keys_are_errors_with_the_closest_match() -> None:
    assert problems({"zero_stge": 2, "overlap_com": True, "xyz": 1}) == [
        "unknown key 'deepspeed_config.zero_stge' in cfg.yaml (did you mean 'zero_stage'?): it is neither an "
        "accelerate DeepSpeed setting nor a DeepSpeed zero_optimization or top-level key; remove it or fix its "
        "spelling",
        "unknown key 'deepspeed_config.overlap_com' in cfg.yaml (did you mean 'overlap_comm'?): it is neither an "
        "accelerate DeepSpeed setting nor a DeepSpeed zero_optimization or top-level key; remove it or fix its "
        "spelling",
        "unknown key 'deepspeed_config.xyz' in cfg.yaml: it is neither an accelerate DeepSpeed setting nor a "
        "DeepSpeed zero_optimization or top-level key; remove it or fix its spelling",
    ]


def test_launcher_keys_are_accepted() -> None:
    block = {
        "deepspeed_multinode_launcher": "standard",
        "deepspeed_hostfile": "/job/hostfile",
        "deepspeed_inclusion_filter": "host1",
        "deepspeed_exclusion_filter": "host2",
        "deepspeed_moe_layer_cls_names": "MixtralSparseMoeBlock",
        "zero3_init_flag": False,
    }
    assert build(block)["zero_optimization"]["stage"] == 2


# ---- mixed precision ---------------------------------------------------------------------------------------------


def test_mixed_precision_enables_fp16_or_bf16() -> None:
    fp16 = build({}, mixed_precision="fp16")
    assert fp16["fp16"] == {"enabled": True, "auto_cast": True} and fp16["bf16"] == {"enabled": False}
    bf16 = build({}, config_mixed_precision="bf16")
    assert bf16["bf16"] == {"enabled": True} and bf16["fp16"] == {"enabled": False}


def test_mixed_precision_fills_auto_and_reports_accelerates_conflict(tmp_path: Path) -> None:
    ds = write_json(tmp_path, {"zero_optimization": {"stage": 1}, "bf16": {"enabled": "auto"}})
    assert build({}, deepspeed_config_file=ds, mixed_precision="bf16")["bf16"] == {"enabled": True}
    ds = write_json(tmp_path, {"zero_optimization": {"stage": 1}, "fp16": {"enabled": True}})
    assert problems({}, deepspeed_config_file=ds, mixed_precision="bf16") == [
        "`--mixed_precision` arg cannot be set to `bf16` when `fp16` is set in the DeepSpeed config file: set "
        'fp16.enabled to false or "auto", or change mixed_precision'
    ]


def test_fp8_is_refused() -> None:
    assert problems({}, mixed_precision="fp8") == [
        "mixed_precision='fp8': accelerate_zero supports 'no', 'fp16' and 'bf16'"
    ]


# ---- deepspeed_config_file ---------------------------------------------------------------------------------------


def test_config_file_autos_are_filled_by_the_plugin_values(tmp_path: Path) -> None:
    ds = write_json(
        tmp_path,
        {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"}, "overlap_comm": True},
        },
    )
    config = build({"deepspeed_config_file": ds}, gradient_clipping=0.3)
    assert config["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "none"}, "overlap_comm": True}
    assert config["gradient_clipping"] == 0.3
    assert config["gradient_accumulation_steps"] == 1  # accelerate adds it when the file has none
    assert config["train_micro_batch_size_per_gpu"] == "auto"  # filled at prepare time
    assert "offload_param" not in config["zero_optimization"]  # as accelerate: absent blocks are not created


def test_config_file_conflicts_with_accelerate_keys(tmp_path: Path) -> None:
    ds = write_json(tmp_path, {"zero_optimization": {"stage": 2}})
    [problem] = problems({"deepspeed_config_file": ds, "zero_stage": 2}, config_mixed_precision="no")
    assert problem.startswith(
        "When using `deepspeed_config_file`, the following accelerate config variables will be ignored: "
        "['gradient_accumulation_steps', 'gradient_clipping', 'zero_stage', 'offload_optimizer_device', "
        "'offload_param_device', 'offload_param_nvme_path', 'offload_optimizer_nvme_path', 'zero3_save_16bit_model', "
        "'mixed_precision']. Found: ['zero_stage', 'mixed_precision']."
    )


def test_config_file_and_zero_optimization_keys_in_the_block_conflict(tmp_path: Path) -> None:
    ds = write_json(tmp_path, {"zero_optimization": {"stage": 2}})
    [problem] = problems({"deepspeed_config_file": ds, "overlap_comm": True, "stage": 2})
    assert problem.startswith(
        "deepspeed_config keys ['overlap_comm', 'stage'] are ignored when using `deepspeed_config_file`"
    )


def test_json_accelerate_config(tmp_path: Path) -> None:
    path = tmp_path / "accelerate.json"
    config = {"distributed_type": "DEEPSPEED", "num_processes": 2, "deepspeed_config": {"zero_stage": 1}}
    path.write_text(json.dumps(config))
    assert prepare_launch(parse("--config_file", str(path))).built.zero_config.zero_optimization.stage == 1


def test_a_flag_contradicting_the_config_file_is_an_error(tmp_path: Path) -> None:
    ds = write_json(tmp_path, {"zero_optimization": {"stage": 2}})
    assert build({}, deepspeed_config_file=ds, zero_stage=2)["zero_optimization"]["stage"] == 2
    assert problems({}, deepspeed_config_file=ds, zero_stage=1) == [
        f"--zero_stage=1 contradicts zero_optimization.stage=2 in deepspeed_config_file {ds}: set "
        'zero_optimization.stage to "auto" in the file to use --zero_stage, or drop --zero_stage'
    ]


def test_config_file_needs_zero_optimization_and_must_be_valid(tmp_path: Path) -> None:
    ds = write_json(tmp_path, {"train_batch_size": 8})
    assert problems({}, deepspeed_config_file=ds) == [
        f"deepspeed_config_file {ds}: Please specify the ZeRO optimization config in the DeepSpeed config "
        '("zero_optimization").'
    ]
    bad = write_json(tmp_path, {"zero_optimization": {"stag": 2}}, name="bad.json")
    [problem] = problems({}, deepspeed_config_file=bad)
    assert problem.startswith(f"deepspeed_config_file {bad}: unknown key 'zero_optimization.stag' (did you mean")
    [problem] = problems({}, deepspeed_config_file=str(tmp_path / "missing.json"))
    assert "cannot read config file" in problem


# ---- whole launches prepared from accelerate config files ----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "stage", "optimizer_device", "param_device"),
    [
        ("zero1.yaml", 1, "none", "none"),
        ("zero2.yaml", 2, "none", "none"),
        ("zero3.yaml", 3, "none", "none"),
        ("zero3_offload.yaml", 3, "cpu", "cpu"),
        ("zero3_nvme.yaml", 3, "nvme", "nvme"),
    ],
)
def test_shipped_configs_parse_and_validate(name: str, stage: int, optimizer_device: str, param_device: str) -> None:
    prepared = prepare_launch(parse("--config_file", str(CONFIGS / name)))
    zero = prepared.built.zero_config.zero_optimization
    assert (zero.stage, zero.offload_optimizer.device, zero.offload_param.device) == (
        stage,
        optimizer_device,
        param_device,
    )
    assert prepared.built.zero_config.bf16.enabled is False and prepared.built.zero_config.fp16.enabled is False
    assert prepared.env["ACCELERATE_ZERO_ZERO_STAGE"] == str(stage)
    assert prepared.env["ACCELERATE_ZERO_ZERO3_INIT_FLAG"] == ("true" if stage == 3 else "false")
    assert (prepared.num_processes, prepared.num_machines) == (2, 1)
    if optimizer_device == "nvme":
        assert zero.offload_optimizer.nvme_path.startswith("/tmp/")
    if param_device == "nvme":
        assert zero.offload_param.nvme_path.startswith("/tmp/")


def check_no_deepspeed(prepared: PreparedLaunch) -> None:
    assert not any(name.startswith(("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED")) for name in prepared.env)
    assert prepared.cluster_config.deepspeed_config == {}
    assert prepared.cluster_config.distributed_type.value in ("MULTI_GPU", "NO")


def test_accelerate_is_handed_a_multi_gpu_config_without_deepspeed() -> None:
    prepared = prepare_launch(parse("--config_file", str(CONFIGS / "zero2.yaml")))
    check_no_deepspeed(prepared)
    assert prepared.cluster_config.distributed_type.value == "MULTI_GPU"
    assert prepared.env["ACCELERATE_USE_CPU"] == "true"  # this machine has no GPU
    one = prepare_launch(parse("--config_file", str(CONFIGS / "zero2.yaml"), "--num_processes", "1"))
    assert one.cluster_config.distributed_type.value == "NO"


@pytest.mark.parametrize("distributed_type", ["MULTI_GPU", "MULTI_CPU", "NO"])
def test_non_deepspeed_configs_take_zero_flags_or_a_config_file(tmp_path: Path, distributed_type: str) -> None:
    path = write_yaml(tmp_path, None, distributed_type=distributed_type, num_processes=2)
    prepared = prepare_launch(parse("--config_file", path, "--zero_stage", "1"))
    assert prepared.built.zero_config.zero_optimization.stage == 1
    check_no_deepspeed(prepared)
    ds = write_json(tmp_path, {"zero_optimization": {"stage": 1, "overlap_comm": True}, "bf16": {"enabled": "auto"}})
    prepared = prepare_launch(parse("--config_file", path, "--deepspeed_config_file", ds, "--mixed_precision", "bf16"))
    assert prepared.built.zero_config.zero_optimization.overlap_comm is True
    assert prepared.built.zero_config.bf16.enabled is True
    assert prepared.cluster_config.distributed_type.value == "MULTI_GPU"


def test_yaml_mixed_precision_conflicts_with_a_config_file_only_in_a_deepspeed_config(tmp_path: Path) -> None:
    ds = write_json(tmp_path, {"zero_optimization": {"stage": 1}})
    multi_gpu = write_yaml(tmp_path, None, distributed_type="MULTI_GPU", mixed_precision="no")
    assert prepare_launch(parse("--config_file", multi_gpu, "--deepspeed_config_file", ds)).num_processes == 2
    deepspeed = write_yaml(tmp_path, {"deepspeed_config_file": ds}, mixed_precision="no")
    with pytest.raises(ZeroConfigError, match=r"Found: \['mixed_precision'\]"):
        prepare_launch(parse("--config_file", deepspeed))


def test_without_a_config_file_the_flags_configure_everything() -> None:
    prepared = prepare_launch(parse("--num_processes", "2", "--zero_stage", "1", "--gradient_clipping", "0"))
    assert (prepared.num_processes, prepared.cluster_config.distributed_type.value) == (2, "MULTI_GPU")
    assert prepared.built.zero_config.zero_optimization.stage == 1
    assert prepared.built.zero_config.gradient_clipping == 0.0
    alone = prepare_launch(parse("--zero_stage", "1"))
    assert (alone.num_processes, alone.cluster_config.distributed_type.value) == (1, "NO")  # no GPU here


def test_moe_names_and_plugin_fields_reach_the_environment(tmp_path: Path) -> None:
    block = {"zero_stage": 1, "gradient_accumulation_steps": 4, "deepspeed_moe_layer_cls_names": "MoeBlock"}
    prepared = prepare_launch(parse("--config_file", write_yaml(tmp_path, block), "--gradient_clipping", "0.5"))
    assert prepared.env[MOE_ENV] == "MoeBlock"
    assert prepared.env["ACCELERATE_ZERO_GRADIENT_ACCUMULATION_STEPS"] == "4"
    assert prepared.env["ACCELERATE_ZERO_GRADIENT_CLIPPING"] == "0.5"
    assert json.loads(prepared.env[CONFIG_ENV])["gradient_accumulation_steps"] == 4


def test_launch_errors(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="no such file"):
        prepare_launch(parse("--config_file", str(tmp_path / "missing.yaml")))
    unknown = write_yaml(tmp_path, {}, not_an_accelerate_key=1)
    with pytest.raises(LaunchError, match=r"had unknown keys \(\['not_an_accelerate_key'\]\)"):
        prepare_launch(parse("--config_file", unknown))
    with pytest.raises(LaunchError, match="accelerate-zero launch runs ZeRO"):
        prepare_launch(parse("--config_file", write_yaml(tmp_path, None, distributed_type="FSDP")))
    with pytest.raises(LaunchError, match="not a multiple of num_machines=2"):
        prepare_launch(
            parse("--config_file", str(CONFIGS / "zero1.yaml"), "--num_processes", "3", "--num_machines", "2")
        )
    pdsh = write_yaml(tmp_path, {"deepspeed_multinode_launcher": "pdsh"}, num_machines=2)
    with pytest.raises(LaunchError, match="deepspeed_multinode_launcher='pdsh'"):
        prepare_launch(parse("--config_file", pdsh))


def test_cli_reports_a_bad_config_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from accelerate_zero.cli.main import main

    path = write_yaml(tmp_path, {"zero_stage": 2, "overlap_com": True, "offload_optimizer_device": "nvme"})
    assert main(["launch", "--config_file", path, "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accelerate-zero launch: invalid ZeRO config, nothing was started:\n")
    assert "unknown key 'deepspeed_config.overlap_com'" in err and "did you mean 'overlap_comm'?" in err
    assert "offload_optimizer_device in " in err and "is 'nvme' but no NVMe folder is set" in err  # all at once
    assert "Traceback" not in err

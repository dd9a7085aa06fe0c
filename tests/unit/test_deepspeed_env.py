"""deepspeed_env.py, key by key: each variable accelerate's DeepSpeed launcher exports becomes the DeepSpeed config
key accelerate's own `DeepSpeedPlugin` makes of it, and the plugin field the ranks read; bad values are refused,
every one named; the environment accelerate 1.15's launcher really writes is read whole."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from accelerate_zero.config import ZeroConfigError
from accelerate_zero.integrations.accelerate import deepspeed_env
from accelerate_zero.integrations.accelerate.deepspeed_env import ACCELERATE_ENV, adopt_accelerate_deepspeed_launch
from accelerate_zero.integrations.accelerate.rank_env import CONFIG_ENV, DEFAULTED_ENV, MOE_ENV


LAUNCHED = {"ACCELERATE_USE_DEEPSPEED": "true"}
"""What marks a rank started by accelerate's DeepSpeed launcher."""


@pytest.fixture(autouse=True)
def _no_launch_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ACCELERATE_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(deepspeed_env, "has_accelerator", lambda: False)


def adopt(variables: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The DeepSpeed config a rank builds from `variables` (as accelerate's launcher exports them), and its
    environment afterwards."""
    environ = {**LAUNCHED, **variables}
    assert adopt_accelerate_deepspeed_launch(environ) is True
    return json.loads(environ[CONFIG_ENV]), environ


def value_at(config: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        config = config[key]
    return config


# (accelerate's variables, the DeepSpeed key they set, its value, the plugin field variable the ranks read)
MAPPING = [
    *[
        pytest.param(
            {"ACCELERATE_DEEPSPEED_ZERO_STAGE": stage}, "zero_optimization.stage", int(stage), ("ZERO_STAGE", stage),
            id=f"stage{stage}",
        )
        for stage in "013"
    ],
    pytest.param(
        {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
        "gradient_accumulation_steps", 4, ("GRADIENT_ACCUMULATION_STEPS", "4"), id="accumulation",
    ),
    pytest.param(
        {"ACCELERATE_GRADIENT_CLIPPING": "0.5"}, "gradient_clipping", 0.5, ("GRADIENT_CLIPPING", "0.5"), id="clipping"
    ),
    pytest.param(
        {"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"},
        "zero_optimization.offload_optimizer.device", "cpu", ("OFFLOAD_OPTIMIZER_DEVICE", "cpu"),
        id="offload-optimizer",
    ),
    pytest.param(
        {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu"},
        "zero_optimization.offload_param.device", "cpu", ("OFFLOAD_PARAM_DEVICE", "cpu"), id="offload-param",
    ),
    pytest.param(
        {
            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "nvme",
            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH": "/nvme/opt",
        },
        "zero_optimization.offload_optimizer.nvme_path", "/nvme/opt", ("OFFLOAD_OPTIMIZER_NVME_PATH", "/nvme/opt"),
        id="optimizer-nvme-path",
    ),
    pytest.param(
        {
            "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
            "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme",
            "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH": "/nvme/param",
        },
        "zero_optimization.offload_param.nvme_path", "/nvme/param", ("OFFLOAD_PARAM_NVME_PATH", "/nvme/param"),
        id="param-nvme-path",
    ),
    pytest.param(
        {"ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true"},
        "zero_optimization.stage3_gather_16bit_weights_on_model_save", True, ("ZERO3_SAVE_16BIT_MODEL", "true"),
        id="save-16bit",
    ),
    pytest.param({"ACCELERATE_MIXED_PRECISION": "bf16"}, "bf16", {"enabled": True}, None, id="bf16"),
    pytest.param({"ACCELERATE_MIXED_PRECISION": "bf16"}, "fp16", {"enabled": False}, None, id="bf16-not-fp16"),
    pytest.param(
        {"ACCELERATE_MIXED_PRECISION": "fp16"}, "fp16", {"enabled": True, "auto_cast": True}, None, id="fp16"
    ),
    pytest.param({"ACCELERATE_MIXED_PRECISION": "no"}, "bf16", {"enabled": False}, None, id="no-mixed-precision"),
]  # fmt: skip


@pytest.mark.parametrize(("variables", "path", "expected", "field"), MAPPING)
def test_each_variable_becomes_its_deepspeed_key(
    variables: dict[str, str], path: str, expected: Any, field: tuple[str, str] | None
) -> None:
    config, environ = adopt(variables)
    assert value_at(config, path) == expected
    if field is not None:
        name, value = field
        assert environ[f"ACCELERATE_ZERO_{name}"] == value


@pytest.mark.parametrize(("variables", "path", "expected", "field"), MAPPING)
def test_each_variable_as_accelerates_deepspeed_plugin_reads_it(
    variables: dict[str, str], path: str, expected: Any, field: tuple[str, str] | None
) -> None:
    from accelerate.utils import DeepSpeedPlugin, patch_environment
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    ours, _ = adopt(variables)
    with patch_environment(**LAUNCHED, **variables, ACCELERATE_DEEPSPEED_ZERO3_INIT="false"):
        plugin = DeepSpeedPlugin()  # reads the same variables, builds its config (deepspeed is not imported)
        plugin.set_mixed_precision(variables.get("ACCELERATE_MIXED_PRECISION", "no"))  # as Accelerator() does
    unset_hf_deepspeed_config()
    theirs = dict(plugin.deepspeed_config)
    theirs.pop("steps_per_print")  # accelerate silences DeepSpeed's logging; accelerate_zero never prints
    assert value_at(ours, path) == value_at(theirs, path)
    assert ours == theirs


def test_clipping_at_zero_is_kept() -> None:
    config, _ = adopt({"ACCELERATE_GRADIENT_CLIPPING": "0.0"})
    assert config["gradient_clipping"] == 0.0  # accelerate drops a falsy value, and DeepSpeed 0.19 then clips at 1.0


def test_nothing_exported_gives_accelerates_defaults_marked_as_defaults() -> None:
    config, environ = adopt({})
    assert config == {
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
    assert set(json.loads(environ[DEFAULTED_ENV])) == {  # a script's own config may say otherwise there
        "gradient_accumulation_steps",
        "gradient_clipping",
        "zero_optimization.stage",
        "zero_optimization.offload_optimizer.nvme_path",
        "zero_optimization.offload_param.nvme_path",
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.offload_param.device",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "fp16.enabled",
        "bf16.enabled",
    }
    assert environ["ACCELERATE_ZERO_ZERO_STAGE"] == "2" and environ["ACCELERATE_ZERO_ZERO3_INIT_FLAG"] == "false"


@pytest.mark.parametrize(
    ("variables", "path", "expected", "field"), [p for p in MAPPING if p.id != "no-mixed-precision"]
)
def test_an_exported_value_is_chosen_not_a_default(
    variables: dict[str, str], path: str, expected: Any, field: tuple[str, str] | None
) -> None:
    _, environ = adopt(variables)
    defaulted = set(json.loads(environ[DEFAULTED_ENV]))
    assert not {path, f"{path}.enabled", path.replace("nvme_path", "device")} & defaulted


@pytest.mark.parametrize(
    ("variables", "flag"),
    [
        ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, "true"),  # accelerate: zero3_init_flag defaults to stage == 3
        ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false"}, "false"),
        ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, "false"),
    ],
)
def test_zero3_init_is_a_plugin_field_not_a_deepspeed_key(variables: dict[str, str], flag: str) -> None:
    config, environ = adopt(variables)
    assert environ["ACCELERATE_ZERO_ZERO3_INIT_FLAG"] == flag
    assert "zero3_init" not in json.dumps(config)


def test_zero3_init_below_stage_3_is_dropped_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="only applies to ZeRO stage 3"):
        _, environ = adopt({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"})
    assert environ["ACCELERATE_ZERO_ZERO3_INIT_FLAG"] == "false"


def test_moe_layer_classes_reach_the_ranks() -> None:
    _, environ = adopt({"ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES": "MixtralSparseMoeBlock,Qwen2MoeSparseMoeBlock"})
    assert environ[MOE_ENV] == "MixtralSparseMoeBlock,Qwen2MoeSparseMoeBlock"


def test_a_deepspeed_config_file_is_read_and_its_autos_filled(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": 0.25,
                "bf16": {"enabled": "auto"},
                "zero_optimization": {"stage": 3, "overlap_comm": False, "offload_param": {"device": "auto"}},
            }
        )
    )
    config, _ = adopt(
        {
            "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path),
            "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2",  # a flag (not in ACCELERATE_CONFIG_DS_FIELDS)
            "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu",
            "ACCELERATE_MIXED_PRECISION": "bf16",
        }
    )
    assert config["gradient_accumulation_steps"] == 2 and config["gradient_clipping"] == 0.25
    assert config["zero_optimization"] == {"stage": 3, "overlap_comm": False, "offload_param": {"device": "cpu"}}
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}


# ---- refusals: what accelerate would refuse, and what accelerate_zero refuses on purpose -------------------------


@pytest.mark.parametrize(
    ("variables", "problem"),
    [
        ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "4"}, "--zero_stage='4': expected a ZeRO stage 0, 1, 2 or 3"),
        (
            {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "0"},
            "--gradient_accumulation_steps='0': expected an integer >= 1",
        ),
        ({"ACCELERATE_GRADIENT_CLIPPING": "-1"}, "--gradient_clipping='-1': expected a number >= 0"),
        (
            {"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "gpu"},
            "--offload_optimizer_device='gpu': expected one of 'none', 'cpu', 'nvme'",
        ),
        ({"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu"}, "--offload_param_device='cpu' needs ZeRO stage 3"),
        ({"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "nvme"}, "is 'nvme' but no NVMe folder is set"),
        ({"ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "maybe"}, "--zero3_save_16bit_model='maybe': expected true"),
        ({"ACCELERATE_MIXED_PRECISION": "fp8"}, "mixed_precision='fp8': accelerate_zero supports 'no', 'fp16' and"),
        (
            {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "5", "ACCELERATE_CONFIG_DS_FIELDS": "zero_stage,mixed_precision"},
            "deepspeed_config.zero_stage in the accelerate config (as `accelerate launch` exported it)='5'",
        ),
    ],
)
def test_a_bad_value_is_refused_naming_it(variables: dict[str, str], problem: str) -> None:
    environ = {**LAUNCHED, **variables}
    with pytest.raises(ZeroConfigError) as raised:
        adopt_accelerate_deepspeed_launch(environ)
    assert any(problem in p for p in raised.value.problems), raised.value.problems
    assert CONFIG_ENV not in environ and environ["ACCELERATE_USE_DEEPSPEED"] == "true"  # nothing half-adopted


def test_every_bad_value_is_refused_at_once() -> None:
    with pytest.raises(ZeroConfigError) as raised:
        adopt({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "9", "ACCELERATE_GRADIENT_CLIPPING": "x"})
    assert len(raised.value.problems) == 2


def test_accelerate_config_keys_next_to_a_deepspeed_config_file_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    variables = {
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path),
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_CONFIG_DS_FIELDS": "deepspeed_config_file,zero_stage,mixed_precision",
    }
    with pytest.raises(ZeroConfigError) as raised:
        adopt(variables)
    (problem,) = [p for p in raised.value.problems if "When using `deepspeed_config_file`" in p]
    assert "Found: ['zero_stage', 'mixed_precision']" in problem


def test_a_missing_deepspeed_config_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ZeroConfigError, match="deepspeed_config_file .*missing.json"):
        adopt({"ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp_path / "missing.json")})


def test_a_flag_contradicting_the_deepspeed_config_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}))
    with pytest.raises(ZeroConfigError, match=r"--gradient_clipping=0.5 contradicts gradient_clipping=1.0"):
        adopt({"ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path), "ACCELERATE_GRADIENT_CLIPPING": "0.5"})


# ---- when it adopts, and what it leaves for accelerate ----------------------------------------------------------


@pytest.mark.parametrize("use_deepspeed", [None, "false", "False"])
def test_not_started_by_the_deepspeed_launcher_changes_nothing(use_deepspeed: str | None) -> None:
    environ = {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    if use_deepspeed is not None:
        environ["ACCELERATE_USE_DEEPSPEED"] = use_deepspeed
    before = dict(environ)
    assert adopt_accelerate_deepspeed_launch(environ) is False
    assert environ == before


@pytest.mark.parametrize(("accelerator", "use_cpu"), [(False, "true"), (True, None)])
def test_accelerate_is_switched_off_its_deepspeed_path(
    monkeypatch: pytest.MonkeyPatch, accelerator: bool, use_cpu: str | None
) -> None:
    monkeypatch.setattr(deepspeed_env, "has_accelerator", lambda: accelerator)
    _, environ = adopt({})
    assert environ["ACCELERATE_USE_DEEPSPEED"] == "false"
    assert environ.get("ACCELERATE_USE_CPU") == use_cpu  # without a GPU accelerate forms the gloo group (MULTI_CPU)


def test_a_config_accelerate_zero_launch_exported_is_kept() -> None:
    mine = json.dumps({"zero_optimization": {"stage": 1}})
    environ = {**LAUNCHED, CONFIG_ENV: mine, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    assert adopt_accelerate_deepspeed_launch(environ) is True
    assert environ[CONFIG_ENV] == mine and environ["ACCELERATE_USE_DEEPSPEED"] == "false"


@pytest.mark.parametrize(("rank", "logged"), [("0", True), ("1", False)])
def test_rank_0_says_deepspeed_is_not_used(caplog: pytest.LogCaptureFixture, rank: str, logged: bool) -> None:
    with caplog.at_level(logging.WARNING, logger=deepspeed_env.__name__):
        adopt({"RANK": rank, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"})
    said = [r.getMessage() for r in caplog.records if "deepspeed is not used" in r.getMessage()]
    assert said == (["`accelerate launch` with a DeepSpeed config: training with accelerate_zero's ZeRO engine "
                     "(stage 3); deepspeed is not used"] if logged else [])  # fmt: skip


# ---- the environment accelerate 1.15's own launcher writes ------------------------------------------------------


def accelerate_launch_env(tmp_path: Path, config: str, *flags: str) -> dict[str, str]:
    """The ACCELERATE_* variables `accelerate launch --config_file CONFIG FLAGS train.py` gives each rank with
    deepspeed installed: accelerate's `launch_command` and `prepare_deepspeed_cmd_env`, without starting anything."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    path = tmp_path / "accelerate.yaml"
    path.write_text(config)
    args = launch_command_parser().parse_args(["--config_file", str(path), *flags, "train.py"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    assert args.use_deepspeed
    fields = list(defaults.deepspeed_config.keys()) + ["mixed_precision"] * mixed_precision_from_config
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    return {name: value for name, value in env.items() if name.startswith("ACCELERATE_")}


TAKEN_OVER = (
    "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 2\nmixed_precision: bf16\n"
    "deepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: cpu\n  offload_param_device: cpu\n"
    "  gradient_accumulation_steps: 2\n  gradient_clipping: 0.5\n  zero3_save_16bit_model: true\n"
    "  zero3_init_flag: false\n  deepspeed_moe_layer_cls_names: MixtralSparseMoeBlock\n"
)


def test_every_variable_accelerates_launcher_exports_is_read(tmp_path: Path) -> None:
    exported = accelerate_launch_env(tmp_path, TAKEN_OVER)
    known = {*ACCELERATE_ENV.values(), "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_MIXED_PRECISION"}
    known |= {"ACCELERATE_CONFIG_DS_FIELDS", "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"}
    assert set(exported) - known == set()
    assert exported["ACCELERATE_USE_DEEPSPEED"] == "true"


def test_an_accelerate_config_as_accelerates_launcher_exports_it(tmp_path: Path) -> None:
    config, environ = adopt(accelerate_launch_env(tmp_path, TAKEN_OVER))
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert (config["gradient_accumulation_steps"], config["gradient_clipping"]) == (2, 0.5)
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert environ["ACCELERATE_ZERO_ZERO3_INIT_FLAG"] == "false" and environ[MOE_ENV] == "MixtralSparseMoeBlock"
    # every key was chosen in the accelerate config, but the NVMe paths: accelerate 1.15 does not export them
    assert set(json.loads(environ[DEFAULTED_ENV])) == {
        "zero_optimization.offload_optimizer.nvme_path",
        "zero_optimization.offload_param.nvme_path",
    }


def test_launch_flags_win_over_the_accelerate_config(tmp_path: Path) -> None:
    exported = accelerate_launch_env(tmp_path, TAKEN_OVER, "--zero_stage", "2", "--offload_param_device", "none")
    config, _ = adopt(exported)
    assert config["zero_optimization"]["stage"] == 2
    assert config["zero_optimization"]["offload_param"]["device"] == "none"


def test_accelerate_config_keys_are_named_as_written_when_refused(tmp_path: Path) -> None:
    exported = accelerate_launch_env(
        tmp_path, TAKEN_OVER.replace("offload_param_device: cpu", "offload_param_device: gpu")
    )
    with pytest.raises(ZeroConfigError) as raised:
        adopt(exported)
    (problem,) = raised.value.problems
    assert problem.startswith(
        "deepspeed_config.offload_param_device in the accelerate config (as `accelerate launch` exported it)='gpu'"
    )

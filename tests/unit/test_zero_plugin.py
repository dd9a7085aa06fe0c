"""ZeroPlugin: explicit arguments, the environment `accelerate-zero launch` sets, and config files."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from accelerate_zero.config import ZeroConfig, ZeroConfigError
from accelerate_zero.integrations.accelerate import ZeroPlugin
from accelerate_zero.integrations.accelerate.launch_config import (
    CONFIG_ENV,
    PLUGIN_FIELDS,
    build_deepspeed_config,
    plugin_env,
    settings_from_accelerate,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ACCELERATE_ZERO_"):
            monkeypatch.delenv(name)


def launcher_env(monkeypatch: pytest.MonkeyPatch, block: dict, **flags: object) -> dict[str, str]:
    """Sets the environment `accelerate-zero launch` would set for this `deepspeed_config` block and flags."""
    env = plugin_env(build_deepspeed_config(settings_from_accelerate(block, flags)))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def test_fields_are_accelerates_deepspeed_plugin_fields_that_apply() -> None:
    from accelerate.utils import DeepSpeedPlugin

    names = [f.name for f in dataclasses.fields(ZeroPlugin) if f.init]
    assert names == ["config", *PLUGIN_FIELDS]
    assert set(PLUGIN_FIELDS) <= {f.name for f in dataclasses.fields(DeepSpeedPlugin)}
    for name in names:
        assert f"        {name} (`" in ZeroPlugin.__doc__  # an Args entry per field, accelerate style


def test_without_anything_it_generates_accelerates_default_config() -> None:
    config = ZeroPlugin().zero_config()
    assert isinstance(config, ZeroConfig)
    assert config.zero_optimization.stage == 2
    assert config.auto_keys() == [
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
    ]  # not resolved: the integration fills them at prepare time


def test_fields_are_read_from_the_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher_env(monkeypatch, {"zero_stage": 1, "overlap_comm": True}, gradient_accumulation_steps=4)
    plugin = ZeroPlugin()
    assert (plugin.zero_stage, plugin.gradient_accumulation_steps, plugin.zero3_init_flag) == (1, 4, False)
    assert plugin.offload_optimizer_device == "none" and plugin.offload_optimizer_nvme_path is None
    config = plugin.zero_config()
    assert config.zero_optimization.stage == 1
    assert config.zero_optimization.overlap_comm is True  # only in ACCELERATE_ZERO_CONFIG
    assert config.gradient_accumulation_steps == 4


def test_explicit_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher_env(monkeypatch, {"zero_stage": 2, "gradient_clipping": 1.0})
    plugin = ZeroPlugin(zero_stage=1, gradient_clipping="0.5")
    assert (plugin.zero_stage, plugin.gradient_clipping) == (1, 0.5)
    config = plugin.zero_config()
    assert (config.zero_optimization.stage, config.gradient_clipping) == (1, 0.5)


def test_nvme_paths_come_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    block = {
        "zero_stage": 3,
        "offload_optimizer_device": "nvme",
        "offload_optimizer_nvme_path": "/tmp/nvme",
        "offload_param_device": "cpu",
    }
    env = launcher_env(monkeypatch, block)
    assert env["ACCELERATE_ZERO_OFFLOAD_OPTIMIZER_NVME_PATH"] == "/tmp/nvme"
    monkeypatch.delenv(CONFIG_ENV)  # the fields alone generate the same offload settings
    plugin = ZeroPlugin()
    assert (plugin.offload_optimizer_device, plugin.offload_optimizer_nvme_path) == ("nvme", "/tmp/nvme")
    zero = plugin.zero_config().zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_optimizer.nvme_path) == ("nvme", "/tmp/nvme")
    assert zero.offload_param.device == "cpu"


def test_an_explicit_config_file_is_filled_not_contradicted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_clipping": "auto", "zero_optimization": {"stage": "auto"}}))
    launcher_env(monkeypatch, {"zero_stage": 2})  # env fields fill "auto" values, the launcher's config is not used
    config = ZeroPlugin(config=path, gradient_clipping=0.1).zero_config()
    assert (config.zero_optimization.stage, config.gradient_clipping) == (2, 0.1)
    assert ZeroPlugin(config={"zero_optimization": {"stage": 1}}).zero_config().zero_optimization.stage == 1
    with pytest.raises(ZeroConfigError) as info:
        ZeroPlugin(config={"zero_optimization": {"stage": 1}}, zero_stage=2)
    assert info.value.problems == [
        "ZeroPlugin(zero_stage=...)=2 contradicts zero_optimization.stage=1 in ZeroPlugin(config=dict): set "
        'zero_optimization.stage to "auto" in the file to use ZeroPlugin(zero_stage=...), or drop '
        "ZeroPlugin(zero_stage=...)"
    ]


def test_a_zero_config_object_is_accepted() -> None:
    source = ZeroConfig.from_any({"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}})
    config = ZeroPlugin(config=source).zero_config()
    assert (config.zero_optimization.stage, config.zero_optimization.reduce_bucket_size) == (1, 1000)


def test_bad_values_fail_at_construction_naming_their_source(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ZeroConfigError) as info:
        ZeroPlugin(zero_stage=7, offload_param_device="disk")
    assert info.value.problems == [
        "ZeroPlugin(zero_stage=...)=7: expected a ZeRO stage 0, 1, 2 or 3",
        "ZeroPlugin(offload_param_device=...)='disk': expected one of 'none', 'cpu', 'nvme'",
    ]
    monkeypatch.setenv("ACCELERATE_ZERO_ZERO3_INIT_FLAG", "maybe")
    with pytest.raises(ZeroConfigError, match="ACCELERATE_ZERO_ZERO3_INIT_FLAG='maybe': expected true or false"):
        ZeroPlugin()
    monkeypatch.delenv("ACCELERATE_ZERO_ZERO3_INIT_FLAG")
    monkeypatch.setenv(CONFIG_ENV, "{not json")
    with pytest.raises(ZeroConfigError, match="ACCELERATE_ZERO_CONFIG is not a JSON object"):
        ZeroPlugin()
    monkeypatch.delenv(CONFIG_ENV)
    with pytest.raises(ZeroConfigError, match="no NVMe folder is set"):
        ZeroPlugin(zero_stage=3, offload_param_device="nvme")


def test_zero3_init_flag_defaults_to_stage_3_and_warns_below() -> None:
    plugin = ZeroPlugin(zero_stage=3)
    assert plugin.zero3_init_flag is None  # not set: the config decides
    from accelerate_zero.integrations.accelerate.launch_config import ZeroSettings

    assert build_deepspeed_config(ZeroSettings(fields={"zero_stage": 3})).fields["zero3_init_flag"] is True
    with pytest.warns(UserWarning, match="only applies to ZeRO stage 3"):
        built = build_deepspeed_config(ZeroSettings(fields={"zero_stage": 2, "zero3_init_flag": True}))
    assert built.fields["zero3_init_flag"] is False


def test_a_config_without_accumulation_steps_takes_the_plugins_value() -> None:
    # The dict does not set gradient_accumulation_steps: accelerate would insert 1 and keep it, silently; nothing
    # contradicts the plugin's 2 (before: refused, saying the dict set 1).
    plugin = ZeroPlugin(config={"zero_optimization": {"stage": 3}}, gradient_accumulation_steps=2)
    assert plugin.zero_config().gradient_accumulation_steps == 2
    assert ZeroPlugin(config={"zero_optimization": {"stage": 3}}).zero_config().gradient_accumulation_steps == 1
    # A value the dict does set still wins over nothing and contradicts a different explicit one, naming both.
    with pytest.raises(ZeroConfigError, match=r"ZeroPlugin\(gradient_accumulation_steps=\.\.\.\)=2 contradicts "):
        ZeroPlugin(
            config={"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 3}}, gradient_accumulation_steps=2
        )

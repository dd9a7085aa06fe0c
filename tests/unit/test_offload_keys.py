"""DeepSpeed's offload keys, as DeepSpeed 0.19.8 names them (issue 40): each one is implemented or refused by name
with its reason and fix, never accepted and ignored."""

from __future__ import annotations

import dataclasses

import pytest

from accelerate_zero.config import ZeroConfig, ZeroConfigError
from accelerate_zero.config.blocks import OffloadOptimizerConfig, OffloadParamConfig
from accelerate_zero.engine.setup import check_implemented


def _offload(**optimizer: object) -> dict:
    return {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", **optimizer}}}


def test_every_key_of_deepspeeds_offload_blocks_is_known() -> None:
    """The installed DeepSpeed's offload blocks have no key our blocks lack (an unknown key is refused at load, so a
    new one would break configs that work with DeepSpeed)."""
    offload_config = pytest.importorskip("deepspeed.runtime.zero.offload_config")
    ours = {
        "offload_optimizer": {f.name for f in dataclasses.fields(OffloadOptimizerConfig)},
        "offload_param": {f.name for f in dataclasses.fields(OffloadParamConfig)},
    }
    theirs = {
        "offload_optimizer": set(offload_config.DeepSpeedZeroOffloadOptimizerConfig.model_fields),
        "offload_param": set(offload_config.DeepSpeedZeroOffloadParamConfig.model_fields),
    }
    for block in ours:
        assert theirs[block] <= ours[block], (block, sorted(theirs[block] - ours[block]))


def test_zenflow_and_super_offload_are_refused_at_load_with_the_fix() -> None:
    raw = _offload(super_offload=True)
    raw["zero_optimization"]["zenflow"] = {"topk_ratio": 0.1}
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig.from_any(raw)
    text = str(info.value)
    assert "zero_optimization.offload_optimizer.super_offload=True is not supported (SuperOffload" in text
    assert "cpuadam_cores_perc sets their share): remove the key or set it to false" in text
    assert "zero_optimization.zenflow={'topk_ratio': 0.1} is not supported (ZenFlow" in text
    assert "offload_optimizer.device cpu runs the exact step): remove the key or set it to null" in text


def test_partial_offload_ratio_is_refused_by_name_before_anything_is_built() -> None:
    """Refused at load, so `accelerate-zero validate` and the launcher refuse it as `initialize` does."""
    with pytest.raises(ZeroConfigError, match=r"offload_optimizer\.ratio=0\.3 is not supported \(partial offload"):
        ZeroConfig.from_any(_offload(ratio=0.3))
    check_implemented(ZeroConfig.from_any(_offload(ratio=1.0)))


def test_the_keys_whose_values_run_the_same_schedule_load() -> None:
    """pipeline_read / pipeline_write / fast_init: our NVMe path always overlaps and always starts the fast way."""
    for key in ("pipeline_read", "pipeline_write", "fast_init"):
        for value in (False, True):
            loaded = ZeroConfig.from_any(_offload(**{key: value})).zero_optimization.offload_optimizer
            assert getattr(loaded, key) is value
    loaded = ZeroConfig.from_any(_offload(cpuadam_cores_perc=0.5)).zero_optimization.offload_optimizer
    assert loaded.cpuadam_cores_perc == 0.5
    with pytest.raises(ZeroConfigError, match="cpuadam_cores_perc=1.5"):
        ZeroConfig.from_any(_offload(cpuadam_cores_perc=1.5))

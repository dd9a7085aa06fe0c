"""The monitor package alone: DeepSpeed's event names, the monitors built on rank 0 only, and the monitors whose
library is missing refused by name at load ([Note: the monitor's events] in monitor/events.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from accelerate_zero.config import ZeroConfig, ZeroConfigError
from accelerate_zero.monitor import StepValues, build_monitors, step_events


def test_events_carry_deepspeeds_names_and_global_samples() -> None:
    values = StepValues(
        samples=64,
        lr=0.5,
        train_loss=1.25,
        loss_scale=1024.0,
        grad_norm=3.0,
        elapsed_ms={"forward": 1.0, "backward": 2.0, "step": 3.0},
        memory_bytes={"parameters": 10, "total": 30},
    )
    assert step_events(values) == [
        ("Train/Samples/train_loss", 1.25, 64),
        ("Train/Samples/lr", 0.5, 64),
        ("Train/Samples/loss_scale", 1024.0, 64),
        ("Train/Samples/grad_norm", 3.0, 64),
        ("Train/Samples/elapsed_time_ms_forward", 1.0, 64),
        ("Train/Samples/elapsed_time_ms_backward", 2.0, 64),
        ("Train/Samples/elapsed_time_ms_step", 3.0, 64),
        ("Train/Samples/memory_parameters_bytes", 10.0, 64),
        ("Train/Samples/memory_total_bytes", 30.0, 64),
    ]
    assert step_events(StepValues(samples=8, lr=0.1)) == [("Train/Samples/lr", 0.1, 8)]


def test_monitors_are_built_on_rank_0_only(tmp_path: Path) -> None:
    config = ZeroConfig.from_any({"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}})
    assert build_monitors(config, rank=1) is None and not (tmp_path / "j").exists()
    monitors = build_monitors(config, rank=0)
    assert monitors is not None
    monitors.write_events([("Train/Samples/lr", 0.5, 8), ("Train/Samples/lr", 0.25, 16)])
    assert (tmp_path / "j" / "Train_Samples_lr.csv").read_text().splitlines() == ["step,lr", "8,0.5", "16,0.25"]
    assert build_monitors(ZeroConfig.from_any({}), rank=0) is None


@pytest.mark.parametrize(
    ("block", "module"), [("wandb", "wandb"), ("comet", "comet_ml"), ("tensorboard", "tensorboard")]
)
def test_a_monitor_without_its_library_is_refused_by_name(
    block: str, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig.from_any({block: {"enabled": True}})
    assert info.value.problems == [
        f"{block}.enabled=true needs the '{module}' package, which is not installed: pip install "
        f"{module.replace('_', '-')} (or switch {block} off)"
    ]
    ZeroConfig.from_any({block: {"enabled": False}})  # off: no library needed

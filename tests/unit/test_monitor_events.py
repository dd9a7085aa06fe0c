"""The monitor package alone: DeepSpeed's event names, the monitors built on rank 0 only, and the monitors whose
library is missing refused by name at load ([Note: the monitor's events] in monitor/events.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

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


class _Recorder:
    """A stand-in for a monitor library (wandb, comet_ml and its experiment): records every call made on it."""

    def __init__(self, calls: list, prefix: str = "") -> None:
        self._calls, self._prefix = calls, prefix

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._calls.append((self._prefix + name, args, kwargs))
            return _Recorder(self._calls, "experiment.") if name == "start" else None

        return call


@pytest.mark.parametrize("block", ["wandb", "comet"])
def test_wandb_and_comet_get_deepspeeds_calls(block: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What DeepSpeed 0.19.8's WandbMonitor and CometMonitor call on their library, for the same events (the libraries
    are stand-ins: neither is installed in the test environment)."""
    module = {"wandb": "wandb", "comet": "comet_ml"}[block]
    calls: list = []
    monkeypatch.setitem(sys.modules, module, _Recorder(calls))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == module else real(name, *a))
    settings = {
        "wandb": {"enabled": True, "project": "p", "group": "g", "team": "t"},
        "comet": {"enabled": True, "project": "p", "samples_log_interval": 16, "experiment_name": "run"},
    }[block]
    monitors = build_monitors(ZeroConfig.from_any({block: settings}), rank=0)
    assert monitors is not None
    monitors.write_events([("Train/Samples/lr", 0.5, 8), ("Train/Samples/train_loss", 2.0, 8)])
    monitors.write_events([("Train/Samples/lr", 0.4, 16), ("Train/Samples/lr", 0.3, 24)])
    monitors.close()
    if block == "wandb":  # init once; one log per event at its step
        assert calls == [
            ("init", (), {"project": "p", "group": "g", "entity": "t"}),
            ("log", ({"Train/Samples/lr": 0.5},), {"step": 8}),
            ("log", ({"Train/Samples/train_loss": 2.0},), {"step": 8}),
            ("log", ({"Train/Samples/lr": 0.4},), {"step": 16}),
            ("log", ({"Train/Samples/lr": 0.3},), {"step": 24}),
            ("finish", (), {}),
        ]
    else:  # an event name is logged again once samples_log_interval samples have passed since it last was
        started = {"api_key": None, "project": "p", "workspace": None, "experiment_key": None}
        assert calls[0] == ("start", (), {**started, "mode": None, "online": None})
        assert calls[1:] == [
            ("experiment.set_name", ("run",), {}),
            ("experiment.log_metric", ("Train/Samples/lr", 0.5), {"step": 8}),
            ("experiment.log_metric", ("Train/Samples/train_loss", 2.0), {"step": 8}),
            ("experiment.log_metric", ("Train/Samples/lr", 0.3), {"step": 24}),
            ("experiment.end", (), {}),
        ]

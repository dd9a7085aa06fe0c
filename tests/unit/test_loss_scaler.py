"""fp16 loss scale: DeepSpeed's dynamic rules (hysteresis, window, minimum) and the static scale."""

from __future__ import annotations

import pytest

from accelerate_zero.engine.loss_scaler import LossScaler


def test_hysteresis_delays_the_drop_and_window_doubles() -> None:
    scaler = LossScaler(dynamic=True, initial_scale=2.0**16, window=3, hysteresis=2)
    scaler.update(overflow=True)
    assert scaler.scale == 2.0**16  # first overflow only uses up hysteresis
    scaler.update(overflow=True)
    assert scaler.scale == 2.0**15
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 2.0**16  # three clean steps after the overflow double it


def test_hysteresis_one_drops_at_once_and_minimum_raises() -> None:
    scaler = LossScaler(dynamic=True, initial_scale=4.0, window=1000, hysteresis=1, min_scale=2.0)
    scaler.update(overflow=True)
    assert scaler.scale == 2.0
    with pytest.raises(RuntimeError, match="already at minimum"):
        scaler.update(overflow=True)


def test_consecutive_hysteresis_refills_on_clean_steps() -> None:
    scaler = LossScaler(dynamic=True, initial_scale=8.0, window=1000, hysteresis=2, consecutive_hysteresis=True)
    scaler.update(overflow=True)
    scaler.update(overflow=False)
    scaler.update(overflow=True)
    assert scaler.scale == 8.0


def test_static_scale_never_moves_and_state_round_trips() -> None:
    scaler = LossScaler(dynamic=False, initial_scale=128.0)
    scaler.update(overflow=True)
    assert scaler.scale == 128.0
    other = LossScaler(dynamic=True, initial_scale=1.0)
    other.load_state_dict(scaler.state_dict())
    assert other.state == scaler.state

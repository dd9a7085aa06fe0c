"""Fixtures shared by the unit tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def clean_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher environment (ACCELERATE_ZERO_*, ACCELERATE_DEEPSPEED_*), and no user default accelerate config."""
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_ZERO_", "ACCELERATE_DEEPSPEED_")):
            monkeypatch.delenv(name)
    monkeypatch.setattr("accelerate_zero.integrations.accelerate.launcher.default_config_file", "/nonexistent.yaml")

"""Session-wide test setup: how many rank processes the session started (tests/helpers/dist.py keeps a pool of
ranks per world size, so this stays a few per world size unless a test failed or asked for fresh ranks)."""

from __future__ import annotations

from typing import Any

import pytest


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    from tests.helpers.dist import spawned_rank_count

    terminalreporter.write_line(f"rank processes started for distributed tests: {spawned_rank_count()}")
